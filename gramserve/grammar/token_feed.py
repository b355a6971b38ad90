"""The token feed: sampled token ids go from the sampler straight to the grammar worker.

Under the overlap schedule a step's grammar masks depend on the previous step's tokens. Routing those tokens
through the scheduler (wait for them, then send them over ZeroMQ) puts the scheduler's own host work (building
and launching the next batch) between the tokens' arrival and the start of the fill. Instead the sampler's
ids are written into a small shared-memory segment, on CUDA by the GPU itself (two stream-ordered copies into
page-locked memory: the ids, then the step number), and the grammar worker, told beforehand which positions
belong to which request (`GrammarStepReq.fed`), waits for the step number and accepts the ids at once.

Layout (int64 words, at the start of the grammar segment, `grammar_shm.py`): word 0 = the step whose ids are
in the feed; words 8.. = the ids (the step number sits on its own cache line). One step's ids are in the feed
at a time: the next step cannot sample before its masks, filled after this step's ids were read, exist.
"""

from __future__ import annotations

import time

import torch

SEQ = 0
IDS = 8


def feed_bytes(rows: int) -> int:
    return (IDS + rows) * 8


class FeedTimeout(RuntimeError):
    pass


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
        ids, seq = self._words[IDS: IDS + n], self._words[SEQ: SEQ + 1]
        if token_ids.device.type == "cuda":
            ids.copy_(token_ids, non_blocking=True)
            self._seq.fill_(step)
            seq.copy_(self._seq, non_blocking=True)  # stream order: lands after the ids
        else:
            ids.copy_(token_ids)
            seq.fill_(step)
        return True
