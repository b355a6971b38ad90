"""The scheduler's statistics: host time per step phase, request and token counters, the /get_server_info report."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from gramserve.model.runner import RunnerInfo
    from gramserve.scheduler.grammar_client import GrammarClient
    from gramserve.scheduler.kv_accounting import KvAccounting


class StepPhases:
    """Host time per part of the scheduler's step (ms, cumulative; /get_server_info shows them).

    launch_forward: pick the batch and queue the forward; wait_tokens: wait for the previous step's sampled ids;
    record_tokens: per-request bookkeeping of those ids (under overlap also asking for the masks of rows the token
    feed does not refill); output: build the detokenizer message and free what finished; grammar_feed: tell the
    grammar processes which of this step's sampled ids will reach them through the token feed (overlap);
    grammar_apply: wait for the grammar masks and apply them; launch_sampling: queue the sampling.

    Also the decode cadence: the wall time from the start of each decode-only step to the start of the next one,
    with its rows, in all and by batch size (`decode_steps` in the snapshot). Benchmarks compare it between runs
    (constrained against free decoding): unlike a client's TPOT it leaves out prefill steps, the client's own load
    and the tail of a run.
    """

    NAMES = (
        "launch_forward",
        "wait_tokens",
        "record_tokens",
        "output",
        "grammar_feed",
        "grammar_apply",
        "launch_sampling",
    )

    def __init__(self):
        self.ms = dict.fromkeys(self.NAMES, 0.0)
        self.steps = 0
        self._t = 0.0
        self.by_rows: dict[int, list] = {}  # decode steps by batch size rounded up to a power of two: [steps, ms, rows]
        self._decode_since: float | None = None  # start of the last step, if it was decode-only
        self._decode_rows = 0
        self._step_start = 0.0

    def start(self) -> None:
        self.steps += 1
        self._t = time.perf_counter()
        if self._decode_since is not None:
            rows = self._decode_rows
            # by batch size, rounded up to a power of two: runs compare steps of the same size
            bucket = self.by_rows.setdefault(1 << max(0, rows - 1).bit_length(), [0, 0.0, 0])
            bucket[0] += 1
            bucket[1] += (self._t - self._decode_since) * 1e3
            bucket[2] += rows
        self._decode_since, self._step_start = None, self._t

    def decoding(self, rows: int) -> None:
        """This step is decode-only with `rows` rows: its cadence counts once the next step starts."""
        self._decode_since, self._decode_rows = self._step_start, rows

    def idle(self) -> None:
        """The loop waits for work: the time until the next step is not the last step's."""
        self._decode_since = None

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] += (now - self._t) * 1e3
        self._t = now

    def snapshot(self) -> dict:
        by_rows = {str(k): [n, round(ms, 3), rows] for k, (n, ms, rows) in sorted(self.by_rows.items())}
        steps, ms, rows = (sum(b[i] for b in self.by_rows.values()) for i in range(3))
        decode = {"steps": steps, "ms": round(ms, 3), "rows": rows, "by_rows": by_rows}
        return {"steps": self.steps, **{k: round(v, 3) for k, v in self.ms.items()}, "decode_steps": decode}


class SchedulerCounters(TypedDict):
    """Cumulative counts since start-up (the report's "stats")."""

    requests_finished: int
    prompt_tokens: int  # computed by prefill steps (prefix-cache hits not counted)
    generation_tokens: int
    forward_steps: int
    retractions: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache at first admission
    mixed_decode_rows: int  # decode tokens computed inside prefill steps (--mixed-decode)
    parked_samples: int  # prompts prefilled while their grammar compiled, then sampled from their saved logits


def zero_counters() -> SchedulerCounters:
    return SchedulerCounters(**dict.fromkeys(SchedulerCounters.__annotations__, 0))


def server_info_report(
    runner: RunnerInfo,
    sampling_backend: str,
    kv: KvAccounting,
    counters: SchedulerCounters,
    num_running: int,
    num_waiting: int,
    num_grammar_compiling: int,
    grammar: GrammarClient | None,
    phases: StepPhases,
) -> dict:
    """The scheduler's part of /get_server_info."""
    allocator, cache = kv.allocator, kv.cache
    return {
        "runner": runner.__dict__,
        "sampling_backend": sampling_backend,
        "kv_pool": {
            "total_slots": allocator.size,
            "free_slots": allocator.num_free,
            # held by requests (their own slots and the cached prefixes they lock)
            "used_slots": allocator.size - allocator.num_free - cache.evictable_size,
            "cached_slots": cache.total_size(),
            "evictable_slots": cache.evictable_size,
            "free_request_rows": kv.req_pool.num_free,
            "max_running_requests": kv.req_pool.max_reqs,
        },
        "prefix_cache": {
            "enabled": not cache.disabled,
            "hit_tokens": cache.stats.hit_tokens,
            "query_tokens": cache.stats.query_tokens,
            "cached_prompt_tokens": counters["cached_prompt_tokens"],
        },
        "num_running": num_running,
        "num_waiting": num_waiting,
        "num_grammar_compiling": num_grammar_compiling,
        "stats": dict(counters),
        **(grammar.report() if grammar is not None else NO_GRAMMAR_REPORT),
        "step_phases_ms": phases.snapshot(),
    }


NO_GRAMMAR_REPORT = {
    "grammar_timing": {},
    "grammar_slots_in_use": 0,
    "grammar_requests_per_shard": [],
    "grammar_live_requests": 0,
}


def status_line(prev: dict, now: dict, seconds: float) -> str | None:
    """One line on what the scheduler did between two server_info reports; None when it did nothing."""
    a, b = prev.get("stats", {}), now.get("stats", {})
    generated = b.get("generation_tokens", 0) - a.get("generation_tokens", 0)
    prompt = b.get("prompt_tokens", 0) - a.get("prompt_tokens", 0)
    busy = now.get("num_running") or now.get("num_waiting") or now.get("num_grammar_compiling")
    if not (generated or prompt or busy):
        return None
    pool = now.get("kv_pool", {})
    used = pool.get("used_slots", 0) / pool["total_slots"] if pool.get("total_slots") else 0.0
    ga, gb = prev.get("grammar_timing") or {}, now.get("grammar_timing") or {}
    steps = gb.get("steps", 0) - ga.get("steps", 0)
    fill = (gb.get("fill_ms", 0.0) - ga.get("fill_ms", 0.0)) / steps if steps else 0.0
    return (
        f"status: running {now.get('num_running', 0)}, waiting {now.get('num_waiting', 0)}, "
        f"compiling {now.get('num_grammar_compiling', 0)}, generation {generated / seconds:.1f} tok/s, "
        f"prompt {prompt / seconds:.1f} tok/s, KV use {used:.0%}, grammar fill {fill:.2f} ms/step"
    )
