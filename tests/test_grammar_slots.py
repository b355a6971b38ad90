"""The scheduler's bitmask slot table (gramserve/scheduler/grammar_slots.py): a request takes the lowest free slot
on first use and keeps it until released; rows the token feed refills wait for their fed step instead of asking
for a fill; a slot released while its owner's fed fill may still run is stale until that step is answered."""

from __future__ import annotations

from gramserve.scheduler.grammar_slots import SlotTable


def test_requests_take_the_lowest_free_slot_and_keep_it():
    table = SlotTable(4)
    pairs, fill, step, _ = table.take([0, 1, 2], ["a", "b", "c"])
    assert pairs == [(0, 0), (1, 1), (2, 2)] and fill == [("a", 0), ("b", 1), ("c", 2)] and step == 0
    assert table.in_use == 3
    assert table.release("b") and not table.release("b")
    pairs, _, _, _ = table.take([0, 1, 2], ["c", "d", "a"])  # "d" gets the slot "b" gave back
    assert pairs == [(0, 2), (1, 1), (2, 0)]
    assert table.slots_of(["a", "d"]) == [0, 1]


def test_fed_rows_wait_for_their_step_instead_of_a_fill():
    table = SlotTable(4)
    table.take([0, 1], ["a", "b"])
    table.mark_fed(["a"], 7)
    pairs, fill, step, _ = table.take([0, 1], ["a", "b"])
    assert pairs == [(0, 0), (1, 1)] and fill == [("b", 1)] and step == 7
    table.forget_fed(["a"])
    assert table.take([0], ["a"])[1:3] == ([("a", 0)], 0)
    table.mark_fed(["a", "b"], 8)
    table.release("a")  # a released request forgets its fed step too
    table.take([0], ["a"])
    assert table.take([0, 1], ["a", "b"])[1:3] == ([("a", 0)], 8)
    table.clear_fed()
    assert table.take([1], ["b"])[1:3] == ([("b", 1)], 0)


def test_a_slot_released_with_a_fed_fill_in_flight_is_stale_for_its_next_owner():
    table = SlotTable(4)
    table.take([0, 1], ["a", "b"])
    table.mark_fed(["a", "b"], 5)
    table.release("a")  # its fill of step 5 may still write slot 0
    table.forget_fed(["b"])
    table.release("b")  # nothing in flight for slot 1
    taken = table.take([0], ["c"])
    assert taken.pairs == [(0, 0)] and taken.fill == [("c", 0)] and taken.stale == 5
    assert table.take([0, 1], ["c", "d"]).stale == 0  # slot 1 was not stale; slot 0's staleness was handed out
