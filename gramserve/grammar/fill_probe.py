"""Measuring what a compiled grammar's masks cost to fill, so that `auto` can pick the cheaper backend.

Backends differ most where a grammar counts: bounded strings (``maxLength``), integer ranges and formats. There
xgrammar's pushdown automaton checks much of the vocabulary at run time (a random walk over an extraction record
filled rows in p50 5 us but p99 3.8 ms), where llguidance's lexer stays near 15-130 us; on unbounded fields the
two cost about the same (docs/benchmarks.md, "Backend choice"). ``probe_fill_us`` walks a fresh matcher through
random allowed tokens (seeded, so a grammar always gets the same walk), timing each fill, and returns the mean
microseconds per row. It runs on the compile thread, after the compile, off the step path, and counts the thread's
CPU time, not wall time: in a busy grammar process a thread waits up to the 5 ms GIL switch interval between two
fills, which wall time once charged to whichever backend was being measured (4,700 us "per row" on a GPU host).
"""

from __future__ import annotations

import random
import time

import numpy as np

from gramserve.grammar.backends.base import GrammarBackend
from gramserve.sampling.bitmask import allocate_bitmask

PROBE_STEPS = 24
PROBE_BUDGET_MS = 25.0  # stop a walk that costs more than this: the backend is expensive, that is all we need


def random_allowed_token(row: np.ndarray, rng: random.Random) -> int | None:
    """A random allowed token of one bitmask row (uniform over non-empty words, then over their bits), or None."""
    words = np.flatnonzero(row)
    if words.size == 0:
        return None
    w = int(words[rng.randrange(words.size)])
    bits = int(row[w]) & 0xFFFFFFFF
    choices = [b for b in range(32) if bits >> b & 1]
    return w * 32 + rng.choice(choices)


def probe_fill_us(
    backend: GrammarBackend,
    compiled: object,
    steps: int = PROBE_STEPS,
    budget_ms: float = PROBE_BUDGET_MS,
    seed: int = 0,
) -> float:
    """Mean us per mask fill over a random walk of up to `steps` tokens (restarted when the grammar ends), taken
    the second time the walk runs: llguidance builds its lexer states lazily, so a first walk costs it 2-3x more
    than every later request's (extraction_record: 130 us, then 54 us)."""
    _walk(backend, compiled, steps, budget_ms, seed)
    return _walk(backend, compiled, steps, budget_ms, seed)


def _walk(backend: GrammarBackend, compiled: object, steps: int, budget_ms: float, seed: int) -> float:
    bitmask = allocate_bitmask(1, backend.vocab_size)
    row = bitmask[0].numpy()
    rng = random.Random(seed)
    matcher = backend.matcher(compiled)
    spent, fills = 0, 0
    for _ in range(steps):
        t0 = time.thread_time_ns()
        matcher.fill_bitmask(bitmask, 0)
        spent += time.thread_time_ns() - t0
        fills += 1
        if spent > budget_ms * 1e6:
            break
        token = random_allowed_token(row, rng)
        if token is None or token in backend.eos_token_ids or not matcher.accept_token(token):
            matcher = backend.matcher(compiled)
        elif matcher.is_terminated():
            matcher = backend.matcher(compiled)
    return spent / max(1, fills) / 1e3
