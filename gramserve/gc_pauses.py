"""Python's garbage collector in the server's long-running processes: the start-up heap frozen, long pauses logged.

A full (generation-2) collection walks every container object a process holds. After start-up that is mostly what
never goes away: the tokenizer's vocabulary, modules, torch's and FastAPI's objects (about 470,000 objects in the
main process, 250 ms a collection on a 2-core machine). Under load the allocations of requests in flight start such
a collection every few seconds, and every stream and step in that process stops for its length. `freeze_heap`,
called once a process is ready, moves the objects it holds then out of the collector's sight (`gc.freeze`, as vLLM
and SGLang do), so later collections walk only what was made since; `watch_pauses` logs a collection that still
takes long.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

SLOW_COLLECTION_MS = 50.0  # a full collection at least this long is logged


def freeze_heap(process: str) -> None:
    """Collect once, then freeze what is left: the process's start-up objects. Call it when the process is ready."""
    gc.collect()
    gc.freeze()
    watch_pauses(process)


def watch_pauses(process: str) -> None:
    """Log each full collection of this process that takes at least SLOW_COLLECTION_MS (once per process)."""
    if any(getattr(cb, "gramserve_watch", False) for cb in gc.callbacks):
        return
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            ms = (time.perf_counter() - started.pop()) * 1e3
            if ms >= SLOW_COLLECTION_MS:
                logger.warning("%s: a full garbage collection took %.0f ms (%d objects frozen)", process, ms,
                               gc.get_freeze_count())  # fmt: skip

    callback.gramserve_watch = True
    gc.callbacks.append(callback)
