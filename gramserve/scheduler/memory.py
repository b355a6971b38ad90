"""KV memory bookkeeping: a token-slot allocator over the KV pool and the per-request slot table.

The slot table (req_to_token) maps (request row, position) to the KV slot holding that position's K/V;
the attention backends read it directly.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    pass


class TokenSlotAllocator:
    """Free list of KV slots 1..size (slot 0 is the padding scratch slot)."""

    def __init__(self, size: int, device: torch.device):
        self.size = size
        self.device = device
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    @property
    def num_free(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._free.numel():
            raise OutOfSlotsError(f"need {n} KV slots, {self._free.numel()} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat([self._free, slots.to(self._free.device, torch.int64)])


class ReqToTokenPool:
    """Rows of the slot table, one per running request."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device):
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs))
        self.max_reqs = max_reqs

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfSlotsError("no free request rows")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(torch.int32)

    def slots(self, row: int, length: int) -> torch.Tensor:
        return self.table[row, :length].to(torch.int64)
