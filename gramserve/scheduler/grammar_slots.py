"""The bitmask slots of the running constrained requests, on the scheduler's side.

Each running constrained request owns one row of the shared bitmask (its *slot*): it takes the lowest free one
the first time its logits are masked and keeps it until `release` (finished or retracted). The table also
remembers which requests' next mask the token feed is refilling (`grammar/token_feed.py`): the fed step whose
fill holds it. Those wait for that step; the others need a fill asked for.

A fed fill can still be running when its request stops (the scheduler reads a step's tokens after the feed has
handed them to the grammar workers). Its slot is then *stale* until that step is answered: a request that takes it
must not have its own first fill asked before, or the two fills (on different workers, when the requests' shards
differ) race to write the row, and the new request may be masked with the old one's last mask.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple


class Taken(NamedTuple):
    """What `SlotTable.take` gives for a step's constrained rows."""

    pairs: list[tuple[int, int]]  # (logits row, slot)
    fill: list[tuple[str, int]]  # (rid, slot) whose mask must be asked for
    step: int  # the latest fed step that the other rows wait for (0: none)
    stale: int  # the latest step whose fill may still write a slot taken here (0: none); wait for it before asking


class SlotTable:
    """Which bitmask row (slot) each running constrained request owns, and which rows the token feed refills."""

    def __init__(self, slots: int):
        self._slot_of: dict[str, int] = {}  # rid -> slot
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._fed_step: dict[str, int] = {}  # rid -> the fed step whose fill holds its next mask
        self._stale: dict[int, int] = {}  # released slot -> the fed step of its last owner (module docstring)

    @property
    def in_use(self) -> int:
        return len(self._slot_of)

    def take(self, rows: list[int], rids: list[str]) -> Taken:
        """For logits rows `rows` of requests `rids`: the (row, slot) pairs; the (rid, slot) pairs whose mask must
        be asked for (the token feed is not refilling them); the latest fed step the others wait for (0: none); the
        latest step whose fill may still write a slot taken here (0: none). A request without a slot takes one
        here."""
        slot_of, fed_step, free = self._slot_of, self._fed_step, self._free
        pairs, fill, step, stale = [], [], 0, 0
        for row, rid in zip(rows, rids):
            slot = slot_of.get(rid)
            if slot is None:
                slot = slot_of[rid] = heapq.heappop(free)
                if self._stale:
                    stale = max(stale, self._stale.pop(slot, 0))
            pairs.append((row, slot))
            fed = fed_step.get(rid)
            if fed is None:
                fill.append((rid, slot))
            elif fed > step:
                step = fed
        return Taken(pairs, fill, step, stale)

    def slots_of(self, rids: list[str]) -> list[int]:
        """The slots of requests that hold one."""
        slot_of = self._slot_of
        return [slot_of[rid] for rid in rids]

    def mark_fed(self, rids: list[str], step: int) -> None:
        """Fed step `step` refills these requests' slots."""
        self._fed_step.update(dict.fromkeys(rids, step))

    def forget_fed(self, rids: list[str]) -> None:
        """The feed refills none of these requests' slots: their next masks are asked for."""
        for rid in rids:
            self._fed_step.pop(rid, None)

    def clear_fed(self) -> None:
        self._fed_step.clear()

    def release(self, rid: str) -> bool:
        """The request stopped running: its slot may go to another request. True if it held one."""
        fed = self._fed_step.pop(rid, None)
        slot = self._slot_of.pop(rid, None)
        if slot is None:
            return False
        if fed is not None:
            self._stale[slot] = fed
        heapq.heappush(self._free, slot)
        return True
