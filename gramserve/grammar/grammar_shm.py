"""The shared memory between the scheduler and the grammar worker: one segment, made by the launcher.

Layout: the token feed (`token_feed.py`: int64 words, padded to whole pages), then the token bitmask
([max_running_requests, ceil(vocab / 32)] int32, bit set = token allowed, one row per running constrained
request). One segment is page-locked with one CUDA registration: registering two neighbouring mappings
separately can fail ("already mapped").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from gramserve.grammar.token_feed import feed_bytes
from gramserve.sampling.bitmask import bitmask_words

logger = logging.getLogger(__name__)

PAGE = 4096


def _feed_region(rows: int) -> int:
    return -(-feed_bytes(rows) // PAGE) * PAGE


def segment_bytes(rows: int, vocab_size: int) -> int:
    return _feed_region(rows) + rows * bitmask_words(vocab_size) * 4


def create_grammar_shm(rows: int, vocab_size: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(create=True, size=segment_bytes(rows, vocab_size))
    shm.buf[: _feed_region(rows)] = bytes(_feed_region(rows))
    return shm


@dataclass
class GrammarShm:
    shm: shared_memory.SharedMemory
    segment: torch.Tensor  # uint8, the whole segment
    feed: torch.Tensor  # int64 [feed words]
    bitmask: torch.Tensor  # int32 [rows, words]

    def close(self) -> None:
        del self.segment, self.feed, self.bitmask
        try:
            self.shm.close()
        except BufferError:  # a view is still referenced somewhere; the mapping goes with the process
            pass


def attach_grammar_shm(name: str, rows: int, vocab_size: int) -> GrammarShm:
    # Attaching registers the segment with the resource tracker that spawned children share with the
    # launcher; the launcher unlinks it (and unregisters) at shutdown.
    shm = shared_memory.SharedMemory(name=name)
    size = segment_bytes(rows, vocab_size)
    segment = torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)
    feed = segment[: feed_bytes(rows)].view(torch.int64)
    bitmask = segment[_feed_region(rows) :].view(torch.int32).view(rows, bitmask_words(vocab_size))
    return GrammarShm(shm, segment, feed, bitmask)


def page_lock(t: torch.Tensor) -> bool:
    """Register a host tensor's memory with CUDA, so copies from and to it are asynchronous DMA. The caller
    must `page_unlock` it before unmapping it: a later mapping at the same address would otherwise look
    registered while the GPU still reads the old pages."""
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if err == 0:
        return True
    logger.warning("cannot page-lock %d bytes of shared memory (cudaError %d)", t.numel() * t.element_size(), err)
    # A failed call leaves its error pending for the next kernel launch check: take it here.
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass
    return False


def page_unlock(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
