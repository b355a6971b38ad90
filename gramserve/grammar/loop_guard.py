"""The loop guard: keeps a constrained JSON output from repeating one span of tokens until max_tokens.

Small models, greedy ones most, fall into exact loops inside JSON values: ``"easy_easy_easy_..."``, a run of
``0``s, ``"controller": {"controller": {...`` (docs/benchmarks.md, issue 19 run 4: two thirds of the outputs cut
at max_tokens ended inside such a string). A grammar cannot forbid them: the schema allows them.

The guard watches each constrained request's accepted tokens. When the last tokens are periodic (period ``p`` up
to ``MAX_PERIOD`` tokens) over a span of at least ``MIN_SPAN`` tokens and ``MIN_REPEATS`` periods, it bans the
token that would continue the loop from the next mask, and remembers the ban: later, whenever the same ``p`` (at
least ``MIN_CONTEXT``) tokens come again, that token is banned again, so the loop cannot start over. Only a token
the grammar allows is ever removed, and never the last one allowed: every output stays inside the grammar, so it
stays valid. Its cost is a few comparisons per accepted token.
"""

from __future__ import annotations

MAX_PERIOD = 32  # longest loop (in tokens) recognised
MIN_SPAN = 16  # a loop is this many tokens of one repeated period ...
MIN_REPEATS = 3  # ... and at least this many whole periods
MIN_CONTEXT = 4  # a remembered ban matches at least this many preceding tokens


# run + p >= these (index p - 1): the latest tokens repeat period p over MIN_SPAN tokens and MIN_REPEATS periods
_RUN_NEEDED = [max(MIN_SPAN, MIN_REPEATS * p) - p for p in range(1, MAX_PERIOD + 1)]
_NO_RUNS = [0] * MAX_PERIOD
_NOTHING: frozenset[int] = frozenset()
_KEEP = max(MAX_PERIOD, MIN_CONTEXT)


class LoopGuard:
    """The loop state of one constrained request: feed it each accepted token, ask what to ban next."""

    __slots__ = ("_tail", "_runs", "_bans", "_lengths")

    def __init__(self) -> None:
        self._tail: list[int] = []  # the latest tokens, oldest first (at most 2 * _KEEP)
        self._runs = _NO_RUNS  # _runs[p - 1]: how many latest tokens equal the token p before them
        self._bans: dict[tuple[int, ...], set[int]] = {}  # preceding tokens -> tokens banned after them
        self._lengths: set[int] = set()  # the context lengths in _bans

    def accept(self, token: int) -> None:
        tail = self._tail
        recent = tail[: -MAX_PERIOD - 1 : -1]  # newest first: recent[p - 1] is the token p back
        if token in recent:
            runs = [r + 1 if t == token else 0 for r, t in zip(self._runs, recent)]
            self._runs = runs + _NO_RUNS[len(runs) :]
        else:  # the common case: no period can be running
            self._runs = _NO_RUNS
        tail.append(token)
        if len(tail) > 2 * _KEEP:
            del tail[:-_KEEP]

    def banned(self) -> frozenset[int] | set[int]:
        """The tokens the next mask must not allow (empty: no loop)."""
        out: set[int] | None = None
        runs, tail = self._runs, self._tail
        if runs is not _NO_RUNS:
            for p, (run, needed) in enumerate(zip(runs, _RUN_NEEDED), start=1):
                if run >= needed:
                    k = max(p, MIN_CONTEXT)
                    if k <= len(tail):
                        self._bans.setdefault(tuple(tail[-k:]), set()).add(tail[-p])
                        self._lengths.add(k)
                    out = {tail[-p]}
                    break  # the shortest period is the loop; its multiples continue with the same token
        for k in self._lengths:
            again = self._bans.get(tuple(tail[-k:]))
            if again:
                out = (out or set()) | again
        return out or _NOTHING
