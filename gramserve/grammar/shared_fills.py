"""Rows in the same matcher state are filled once a step: the others copy the first one's finished row.

A matcher's state, and its loop guard's, are functions of the grammar and the tokens it has accepted: two requests
of one grammar (same backend, kind and text) that accepted the same tokens get the same mask. Each request carries
a key of its grammar and its accepted tokens (128 bits, two chained hashes updated per token); in a step, rows with
one key are filled (and narrowed by the loop guard) once, and the others copy that row.

Where it acts: requests of one schema that write the same tokens: the `n` choices of one request until they part,
greedy requests over near-identical prompts (bulk jobs), and the suite's greedy random-weight rows, which all
write the same text and reach the dearest masks together (a bounded string near its maxLength, 0.2-0.4 ms a row
with llguidance). Sampled rows part within a few tokens, and every row is then filled on its own as before.
"""

from __future__ import annotations

Key = tuple[int, int]


class StateKeys:
    """The state key of each request whose matcher the grammar service holds."""

    def __init__(self) -> None:
        self._key: dict[str, Key] = {}

    def start(self, rid: str, grammar: tuple[str, str, str]) -> None:
        """A new matcher for `grammar` ((backend, kind, text)): its state is the grammar's start."""
        self._key[rid] = (hash(("lo", *grammar)), hash(("hi", *grammar)))

    def accept(self, rid: str, token: int) -> None:
        key = self._key.get(rid)
        if key is not None:
            # Two differently ordered chains: a collision needs both 64-bit hashes to collide at once.
            self._key[rid] = (hash((key[0], token)), hash((token, key[1], 1)))

    def forget(self, rid: str) -> None:
        """The request is gone, or its matcher refused a token (its state is no longer a function of the key)."""
        self._key.pop(rid, None)

    def split(self, rids: list[str]) -> tuple[list[int], list[tuple[int, int]]]:
        """For a step's rows (their requests `rids`, in row order): the indices of the rows to fill, one per state,
        and (copy, filled) index pairs for the rows whose state an earlier row has."""
        keys, first = self._key, {}
        fill, copies = [], []
        for i, rid in enumerate(rids):
            key = keys.get(rid)
            if key is None:
                fill.append(i)
            elif (j := first.setdefault(key, i)) == i:
                fill.append(i)
            else:
                copies.append((i, j))
        return fill, copies
