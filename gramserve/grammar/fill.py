"""Filling one step's bitmask rows in batches: grouped by backend, on several threads where it pays.

``fill_rows`` groups the (matcher, row) pairs of a step by matcher class and hands each group of at least
``FillPool.min_batch_rows`` rows to that class's ``Matcher.fill_rows`` hook; smaller groups, and every
group when the pool is off (0 threads), are filled row by row with ``Matcher.fill_bitmask``. A batch of
at least ``FillPool.parallel_rows`` rows runs on ``FillPool.threads`` threads, a smaller one on one.

* xgrammar: one ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` call (its own C++ threads; with
  one thread it runs on the caller's and still beats row by row, having no per-row Python).
* llguidance: one ``LLExecutor.unsafe_compute_mask_ptr`` call (its own Rust threads) from
  ``parallel_rows`` rows on; below, row by row (the executor's hand-off costs more than it saves).
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
    # Fewer rows than this run the batch on one thread (llguidance: row by row): waking a pool of threads costs
    # ~0.1 ms. Measured (docs/benchmarks.md): xgrammar at 16 rows 1.6x faster than row by row on one thread, 0.9x
    # on two; on the 16-core GPU host 32 rows took 0.35 / 0.30 / 0.42 ms on 1 / 4 / 8 threads, 256 rows
    # 2.5 / 1.3 / 1.2 ms; llguidance gained nothing from its executor at 64 rows.
    parallel_rows: int = 64
    _executors: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)

    def batched(self, rows: int) -> bool:
        return self.threads > 0 and rows >= self.min_batch_rows

    def threads_for(self, rows: int) -> int:
        return max(1, self.threads) if rows >= self.parallel_rows else 1

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
