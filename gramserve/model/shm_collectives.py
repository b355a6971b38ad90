"""Collectives between the tensor-parallel ranks of one host, through shared memory (CPU tensors).

gloo moves every all-reduce over loopback TCP: each costs a few socket wake-ups, 6-9 ms on the 2-core CI VM, and a
forward of the default model runs 62 of them. Here each rank copies its part into its own slot of one shared
segment, bumps its sequence number, and waits (spinning, yielding the core) until every rank has bumped its own;
then each reads the slots it needs. Slots alternate between two parities by sequence number, so a rank may start
the next operation while slower ranks still read the last one without a second wait: a rank can only be one
operation ahead, since an operation's wait needs every rank to have finished reading the one before.
Tensors larger than a slot go through in slot-sized chunks, one operation each.

x86 keeps stores in order (the data lands before the sequence number that announces it), which this relies on.
"""

from __future__ import annotations

import os
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # one rank's share of one operation
_SEQ_STRIDE = 8  # int64s between two ranks' sequence numbers: one cache line each


class ShmCollectives:
    def __init__(self, rank: int, size: int, name: str | None):
        """Rank 0 passes name=None and creates the segment (its name: `self.name`); the others attach to it."""
        self.rank, self.size = rank, size
        nbytes = size * _SEQ_STRIDE * 8 + 2 * size * SLOT_BYTES
        if name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
            self.shm.buf[: size * _SEQ_STRIDE * 8] = bytes(size * _SEQ_STRIDE * 8)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            resource_tracker.unregister(self.shm._name, "shared_memory")  # rank 0 owns it
        self.name = self.shm.name
        self._seqs = np.ndarray((size, _SEQ_STRIDE), dtype=np.int64, buffer=self.shm.buf)
        data = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=size * _SEQ_STRIDE * 8)
        self._slots = data.view(2, size, SLOT_BYTES)
        self._seq = 0

    def unlink(self) -> None:
        """Rank 0, once every rank has attached: the name goes, the mappings stay."""
        self.shm.unlink()

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self._slots[parity, rank].view(dtype)[:n]

    def _publish_and_wait(self) -> int:
        self._seq += 1
        self._seqs[self.rank, 0] = self._seq
        column = self._seqs[:, 0]
        while column.min() < self._seq:
            os.sched_yield()
        return self._seq % 2

    def _chunks(self, x: torch.Tensor):
        flat = x.view(-1)
        per = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), per):
            yield flat[start : start + per]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (x contiguous)."""
        for chunk in self._chunks(x):
            n = chunk.numel()
            parity = (self._seq + 1) % 2
            self._slot(parity, self.rank, x.dtype, n).copy_(chunk)
            self._publish_and_wait()
            chunk.copy_(self._slot(parity, 0, x.dtype, n))
            for r in range(1, self.size):
                chunk.add_(self._slot(parity, r, x.dtype, n))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x (x contiguous, the same shape on every rank)."""
        out = torch.empty((self.size, x.numel()), dtype=x.dtype)
        per = SLOT_BYTES // x.element_size()
        for i, chunk in enumerate(self._chunks(x)):
            n = chunk.numel()
            parity = (self._seq + 1) % 2
            self._slot(parity, self.rank, x.dtype, n).copy_(chunk)
            self._publish_and_wait()
            for r in range(self.size):
                out[r, i * per : i * per + n].copy_(self._slot(parity, r, x.dtype, n))
        return out.view(self.size, *x.shape)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x, in place (x contiguous)."""
        for chunk in self._chunks(x):
            n = chunk.numel()
            parity = (self._seq + 1) % 2
            if self.rank == 0:
                self._slot(parity, 0, x.dtype, n).copy_(chunk)
            self._publish_and_wait()
            if self.rank != 0:
                chunk.copy_(self._slot(parity, 0, x.dtype, n))
        return x
