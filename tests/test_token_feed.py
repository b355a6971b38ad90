"""The token feed between the sampler and the grammar worker (grammar/token_feed.py), on CPU tensors: ids
published for a step are read back at the asked positions, a reader waits for a later step, a step that never
comes times out, and a batch larger than the feed is refused (the scheduler then sends the accepts itself). Both
ends' memory of the last fed step: a worker accepts a step's fed ids after its queued accepts and reuses its rows
for a `repeat_fed` step; the scheduler's layout hands out the same (row, slot) list while the rows stay the same."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gramserve.grammar.grammar_shm import attach_grammar_shm, create_grammar_shm
from gramserve.grammar.token_feed import FedLayout, FeedReader, FeedTimeout, FeedWriter, ShardState, take_fed_ids
from gramserve.messages import GrammarStepReq


@pytest.fixture
def feed():
    shm = create_grammar_shm(16, 1000)
    scheduler_side = attach_grammar_shm(shm.name, 16, 1000)  # as the scheduler and the grammar worker attach
    grammar_side = attach_grammar_shm(shm.name, 16, 1000)
    writer = FeedWriter(scheduler_side.feed, torch.device("cpu"))
    reader = FeedReader(grammar_side.shm.buf, 16)
    yield writer, reader
    reader.close()
    del writer
    scheduler_side.close()
    grammar_side.close()
    shm.close()
    shm.unlink()


def test_published_ids_are_read_at_their_positions(feed):
    writer, reader = feed
    assert writer.publish(1, torch.tensor([5, 49151, 0, 7]))
    assert reader.wait(1, [3, 0, 1], busy=False, timeout_s=1) == [7, 5, 49151]
    assert writer.publish(2, torch.tensor([11, 12]))
    assert reader.wait(2, [1], busy=True, timeout_s=1) == [12]


def test_a_reader_waits_for_its_step(feed):
    writer, reader = feed
    writer.publish(1, torch.tensor([1]))
    later = threading.Timer(0.2, writer.publish, args=(2, torch.tensor([42, 43])))
    later.start()
    t0 = time.monotonic()
    assert reader.wait(2, [1], busy=False, timeout_s=5) == [43]
    assert time.monotonic() - t0 >= 0.15
    later.join()


def test_a_step_that_never_comes_times_out(feed):
    writer, reader = feed
    writer.publish(3, torch.tensor([1]))
    with pytest.raises(FeedTimeout):
        reader.wait(4, [0], busy=False, timeout_s=0.1)


def test_a_batch_larger_than_the_feed_is_refused(feed):
    writer, _ = feed
    assert not writer.publish(1, torch.arange(17))
    assert writer.publish(1, torch.arange(16))


def test_a_worker_accepts_fed_ids_and_reuses_its_rows_on_repeat(feed):
    writer, reader = feed
    state = ShardState()
    first = GrammarStepReq(1, [("queued", 9)], [("a", 3), ("b", 0)], [], fed=[("a", 2), ("b", 0)])
    writer.publish(1, torch.tensor([10, 11, 12]))
    take_fed_ids(first, state, reader, timeout_s=1)
    assert first.accept == [("queued", 9), ("a", 12), ("b", 10)]
    repeat = GrammarStepReq(2, [], [], [], repeat_fed=True)
    writer.publish(2, torch.tensor([20, 21, 22]))
    take_fed_ids(repeat, state, reader, timeout_s=1)
    assert repeat.fill == [("a", 3), ("b", 0)] and repeat.fed == first.fed  # filled like the step it repeats
    assert repeat.accept == [("a", 22), ("b", 20)]
    plain = GrammarStepReq(3, [("a", 5)], [("a", 3)], [])  # nothing fed: nothing to wait for
    take_fed_ids(plain, state, reader, timeout_s=0)
    assert plain.accept == [("a", 5)]


def test_a_repeat_without_fed_rows_is_an_error(feed):
    _, reader = feed
    with pytest.raises(RuntimeError):
        take_fed_ids(GrammarStepReq(1, [], [], [], repeat_fed=True), ShardState(), reader, timeout_s=0)


def test_the_layout_hands_out_one_pairs_list_while_the_rows_stay():
    layout = FedLayout(["a", "b"], [0, 2], [5, 7], [0])
    pairs = layout.pairs_for([0, 2])
    assert pairs == [(0, 5), (2, 7)]
    assert layout.pairs_for([0, 2]) is pairs  # MaskApplier skips uploading a list it has seen last
    assert layout.pairs_for([1, 3]) == [(1, 5), (3, 7)]
