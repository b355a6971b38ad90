"""Whether the server can serve: the scheduler's heartbeat, a dead child process, a shutdown in progress.

The scheduler loop writes the monotonic time into a shared double at every turn (at least once a second when
idle). /health answers 503 while the heartbeat is older than `--watchdog-timeout`, after a child process died,
while the server drains for a shutdown, and while it warms up (server/warmup.py); new generation requests get the
same 503, and the TokenizerManager fails the requests in flight (tokenizer_manager.fail_all) instead of letting
them hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServerHealth:
    # multiprocessing Value('d'): the scheduler loop's last time.monotonic(), 0 before its first; a list of them
    # under data parallelism (one per replica)
    heartbeat: Any
    watchdog_timeout: float  # seconds without a heartbeat before the scheduler counts as stalled
    dead_child: str | None = None
    draining: bool = False
    warming: bool = False  # server/warmup.py runs its cases; only its own requests are taken meanwhile
    dead_replicas: set[int] = field(default_factory=set)  # data parallelism: replicas stopped after a failure

    def heartbeat_age(self) -> float | None:
        """Seconds since the stalest live scheduler loop last turned (None before every one has turned)."""
        beats = self.heartbeat if isinstance(self.heartbeat, (list, tuple)) else [self.heartbeat]
        lasts = [b.value if b is not None else 0.0 for i, b in enumerate(beats) if i not in self.dead_replicas]
        if not lasts or not all(lasts):
            return None
        return time.monotonic() - min(lasts)

    def problem(self, warmup_request: bool = False) -> str | None:
        """Why the server cannot take requests now; None when it can (`warmup_request`: one of the warm-up's)."""
        if self.dead_child is not None:
            return f"the {self.dead_child} process died; the server is stopping"
        if self.draining:
            return "the server is shutting down"
        if self.warming and not warmup_request:
            return "the server is warming up"
        age = self.heartbeat_age()
        if age is not None and age > self.watchdog_timeout:
            return f"the scheduler has not responded for {age:.0f} s"
        return None
