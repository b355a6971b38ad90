"""The token feed between the sampler and the grammar worker (grammar/token_feed.py), on CPU tensors: ids
published for a step are read back at the asked positions, a reader waits for a later step, a step that never
comes times out, and a batch larger than the feed is refused (the scheduler then sends the accepts itself)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gramserve.grammar.grammar_shm import attach_grammar_shm, create_grammar_shm
from gramserve.grammar.token_feed import FeedReader, FeedTimeout, FeedWriter


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
