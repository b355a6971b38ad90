"""Filling one step's bitmask rows in batches: grouped by backend, on several threads where it pays.

``fill_rows`` groups the (matcher, row) pairs of a step by matcher class and hands each group of at least
``FillPool.min_batch_rows`` rows to that class's ``Matcher.fill_rows`` hook; smaller groups, and every
group when the pool is off (0 threads), are filled row by row with ``Matcher.fill_bitmask``. A batch runs on
``FillPool.threads`` threads when it has at least ``FillPool.parallel_rows`` rows or when its rows, at the
per-row cost measured for that backend lately (``FillPool.record``), would take one thread at least
``FillPool.parallel_us``; otherwise on one (waking threads costs about 0.1 ms).

* xgrammar: one ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` call (its own C++ threads; with
  one thread it runs on the caller's and still beats row by row, having no per-row Python).
* llguidance: matchers deep-copied from one compiled prototype share a lock, so rows of one grammar never
  fill in parallel from one prototype (measured: 2 threads, 32 rows, 1.0x). After its first compile has
  answered, each grammar is compiled again in the background up to one prototype per fill thread (*lanes*,
  ``GrammarBackend.fill_lanes`` / ``add_lanes``), matchers copy the lanes' prototypes in turn, and one
  ``LLExecutor`` call (its own Rust threads) takes the rows ordered by lane: 32 rows in one costly state, 2
  threads, 1.9x faster than row by row (1.0x from one prototype).
* outlines-core: row by row; ``Guide.write_mask_into`` holds the GIL, so Python threads would not help.

Both paths write identical rows (``tests/test_grammar_parallel_fill.py``). If a batch hook raises, the
group is filled again row by row, so a backend bug in the batch API cannot fail a step that the serial
path would have served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gramserve.config import available_cores
from gramserve.grammar.backends.base import Matcher

logger = logging.getLogger(__name__)

AUTO = "auto"
MAX_AUTO_THREADS = 8


def resolve_fill_threads(value: int | str | None, shards: int = 1) -> int:
    """``"auto"``/None -> this process's share of half the cores (shared by ``shards`` grammar workers),
    1 to 8 (the other half serves the scheduler, HTTP and the compile threads); an int as given; 0 turns
    batching off."""
    if value is None or value == AUTO:
        return min(MAX_AUTO_THREADS, max(1, available_cores() // 2 // max(1, shards)))
    threads = int(value)
    if threads < 0:
        raise ValueError(f"grammar fill threads must be >= 0 or 'auto', got {value!r}")
    return threads


@dataclass
class FillPool:
    """Threads for one process's mask filling, and the native executors made for them."""

    threads: int = 1
    # Fewer rows of one backend than this are filled row by row: batching them saves microseconds.
    min_batch_rows: int = 4
    # This many rows always run on `threads` threads. Measured (docs/benchmarks.md): xgrammar at 16 rows 1.6x
    # faster than row by row on one thread, 0.9x on two; on the 16-core GPU host 32 rows took 0.35 / 0.30 / 0.42
    # ms on 1 / 4 / 8 threads, 256 rows 2.5 / 1.3 / 1.2 ms.
    parallel_rows: int = 64
    # Fewer rows run on threads too when one thread would take this long at their backend's recent cost per
    # row (llguidance: 10-40 us a row in most states, 0.3-1 ms inside strings with maxLength near their end).
    parallel_us: float = 300.0
    _executors: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)
    _row_us: dict[str, float] = field(default_factory=dict, repr=False)  # backend -> moving mean us per row

    def batched(self, rows: int) -> bool:
        return self.threads > 0 and rows >= self.min_batch_rows

    def threads_for(self, rows: int, key: str = "") -> int:
        if self.threads <= 1:
            return 1
        if rows >= self.parallel_rows or rows * self._row_us.get(key, 0.0) >= self.parallel_us:
            return self.threads
        return 1

    def record(self, key: str, rows: int, seconds: float, threads: int) -> None:
        """A batch of `rows` took `seconds` on `threads` threads: update the backend's cost per row (thread time)."""
        if rows <= 0:
            return
        us = seconds * 1e6 * threads / rows
        old = self._row_us.get(key)
        self._row_us[key] = us if old is None else 0.8 * old + 0.2 * us

    def row_us(self, key: str) -> float | None:
        return self._row_us.get(key)

    def executor(self, key: str, threads: int, make: Callable[[int], object]) -> object:
        """The backend's batch executor for this many threads (made once with ``make(threads)``)."""
        ex = self._executors.get((key, threads))
        if ex is None:
            ex = self._executors[(key, threads)] = make(threads)
        return ex


def fill_rows(items: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor, pool: FillPool) -> None:
    """Fill ``bitmask[row]`` for every (matcher, row), batching per matcher class where the pool says so."""
    groups: dict[type[Matcher], list[tuple[Matcher, int]]] = {}
    for m, row in items:
        groups.setdefault(type(m), []).append((m, row))
    # Batch hooks write rows from several threads straight into the tensor's memory.
    batchable = bitmask.is_contiguous() and len({row for _, row in items}) == len(items)
    for cls, group in groups.items():
        if batchable and pool.batched(len(group)):
            try:
                cls.fill_rows(group, bitmask, pool)
                continue
            except Exception:  # noqa: BLE001 - the serial path below is the reference behaviour
                logger.exception(
                    "batched mask fill failed for %d %s rows; filling them one by one", len(group), cls.__name__
                )
        for m, row in group:
            m.fill_bitmask(bitmask, row)
