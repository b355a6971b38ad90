"""The token feed: sampled token ids go from the sampler straight to the grammar workers. Both ends live here.

Under the overlap schedule a step's grammar masks depend on the previous step's tokens. Routing those tokens
through the scheduler (wait for them, then send them over ZeroMQ) puts the scheduler's own host work (building
and launching the next batch) between the tokens' arrival and the start of the fill. Instead the sampler's
ids are written into a small shared-memory segment, and the grammar worker, told beforehand which positions
belong to which request, waits for them there and accepts them at once.

One fed step, end to end:

1. Announce (scheduler, `GrammarClient.announce_feed`, before the step samples): each shard with constrained
   rows in the step gets step `s`'s `GrammarStepReq`, whose `fed` lists (rid, position among the step's sampled
   ids) and whose `fill` lists (rid, slot) for those rows.
2. Publish (scheduler, `FeedWriter.publish`, right after the sampling is queued): the ids, then the step number
   `s`, go into the feed; on CUDA by the GPU itself (two stream-ordered copies into page-locked memory), so the
   scheduler does not wait for them.
3. Wait (worker, `FeedReader.wait`): the worker polls the feed's step number until it reaches `s`.
4. Accept (worker, `take_fed_ids`): the ids at the announced positions are accepted, after the step's `accept`.
5. Fill: the worker fills the rows' slots and answers step `s`. The mask for the next step exists before the
   scheduler has even read the ids itself; the scheduler waits for step `s` (`GrammarClient.wait`) before it
   applies that mask.

In steady decode the constrained rows are the same from step to step. The scheduler then remembers the last
fed layout (`FedLayout`): the next step's (row, slot) pairs come without per-row work, and each shard is sent
`repeat_fed` instead of the same rows again; the worker reuses its rows of the last fed step (`FedRows`, kept
in its `ShardState`).

Layout (int64 words, at the start of the grammar segment, `grammar_shm.py`): word 0 = the step whose ids are
in the feed; words 8.. = the ids (the step number sits on its own cache line). One step's ids are in the feed
at a time: the next step cannot sample before its masks, filled after this step's ids were read, exist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gramserve.messages import GrammarStepReq

SEQ = 0
IDS = 8
FEED_TIMEOUT_S = 60.0  # a step's ids are due within one forward; this only guards against a dead scheduler


def feed_bytes(rows: int) -> int:
    return (IDS + rows) * 8


class FeedTimeout(RuntimeError):
    pass


# --- the scheduler's side -------------------------------------------------------------------------


class FeedWriter:
    """The scheduler's side: publish a step's sampled ids (device tensor) without waiting for them."""

    def __init__(self, words: torch.Tensor, device: torch.device):
        """`words`: the feed (int64, shared memory); on CUDA it must be page-locked (`grammar_shm.page_lock`),
        so the GPU's copies into it are asynchronous DMA writes."""
        self._words = words
        self.rows = words.shape[0] - IDS
        if device.type == "cuda":
            self._seq = torch.zeros(1, dtype=torch.int64, device=device)

    def publish(self, step: int, token_ids: torch.Tensor) -> bool:
        """Queue the ids, then the step number, into the feed; False if they do not fit (send them instead)."""
        n = token_ids.shape[0]
        if n > self.rows:
            return False
        ids, seq = self._words[IDS : IDS + n], self._words[SEQ : SEQ + 1]
        if token_ids.device.type == "cuda":
            ids.copy_(token_ids, non_blocking=True)
            self._seq.fill_(step)
            seq.copy_(self._seq, non_blocking=True)  # stream order: lands after the ids
        else:
            ids.copy_(token_ids)
            seq.fill_(step)
        return True


@dataclass
class FedLayout:
    """The scheduler's memory of the constrained rows of the last fed step: which requests (`rids`), at which
    positions of the sampled ids, in which slots, on which shards; `step`: the fed step. Valid while no slot
    changes hands."""

    rids: list[str]
    positions: list[int]
    slots: list[int]
    shards: list[int]
    step: int = 0
    rows: list[int] | None = None  # the logits rows of the last `masks_for` that hit this layout
    pairs: list[tuple[int, int]] | None = None  # ... and its (row, slot) pairs (the same list object each hit)

    def pairs_for(self, rows: list[int]) -> list[tuple[int, int]]:
        """The (logits row, slot) pairs of these requests at logits rows `rows`. While the rows stay the same
        this is the same list object, which tells `MaskApplier` that the pairs are on the device already."""
        if rows != self.rows:
            self.rows, self.pairs = rows, list(zip(rows, self.slots))
        return self.pairs


# --- the grammar worker's side --------------------------------------------------------------------


class FeedReader:
    """The grammar worker's side: wait for a step's ids (read through a memoryview: no torch per read)."""

    def __init__(self, buf: memoryview, rows: int):
        self._bytes = buf[: feed_bytes(rows)]
        self._words = self._bytes.cast("q")

    def wait(self, step: int, positions: list[int], busy: bool, timeout_s: float) -> list[int]:
        """The ids at `positions` once step `step`'s ids are in the feed. Busy: poll without sleeping."""
        words = self._words
        if words[SEQ] < step:
            deadline = time.monotonic() + timeout_s
            while words[SEQ] < step:
                if time.monotonic() > deadline:
                    raise FeedTimeout(f"the ids of step {step} never reached the token feed")
                if not busy:
                    time.sleep(20e-6)
        return [words[IDS + p] for p in positions]

    def close(self) -> None:
        self._words.release()
        self._bytes.release()


@dataclass
class FedRows:
    """A worker's rows of the last step sent with `fed` (`GrammarStepReq.repeat_fed` reuses them)."""

    fill: list[tuple[str, int]]
    fed: list[tuple[str, int]]
    positions: list[int]
    rids: list[str]

    @classmethod
    def of(cls, msg: GrammarStepReq) -> FedRows:
        return cls(msg.fill, msg.fed, [pos for _, pos in msg.fed], [rid for rid, _ in msg.fed])


@dataclass
class ShardState:
    """What one grammar worker keeps between step messages."""

    last_fed: FedRows | None = None


def take_fed_ids(msg: GrammarStepReq, state: ShardState, feed: FeedReader, timeout_s: float = FEED_TIMEOUT_S) -> None:
    """Wait for the ids of step `msg`'s fed rows and queue them after `msg.accept`. The fed rows are those sent
    with it or, with `repeat_fed`, those of the last fed step (then also set on `msg`, so that they are filled)."""
    rows = None
    if msg.repeat_fed:
        rows = state.last_fed
        if rows is None:
            raise RuntimeError(f"step {msg.step} repeats the fed rows, but none were sent before")
        msg.fill, msg.fed = rows.fill, rows.fed
    elif msg.fed:
        rows = state.last_fed = FedRows.of(msg)
    if rows is not None:
        ids = feed.wait(msg.step, rows.positions, busy=msg.busy_poll_ms > 0, timeout_s=timeout_s)
        msg.accept = msg.accept + list(zip(rows.rids, ids))
