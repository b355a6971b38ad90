"""Grammar bitmasks onto the logits, on the logits' device.

The grammar process writes one bitmask row per constrained request into shared host memory; `MaskApplier`
masks the matching logits rows with them.

* CPU: `apply_bitmask` on the shared rows directly.
* CUDA: the rows are packed with their logits row index into one of a few page-locked staging buffers
  (allocated once), copied to the GPU in one non-blocking copy and applied by one Triton kernel
  (`bitmask_kernel`), which also disallows logits columns past the grammar's vocabulary. Nothing waits for
  the GPU: a staging buffer is refilled only after the copy that read it has run (its event), which is long
  done by the time the ring comes round.
"""

from __future__ import annotations

import torch

from gramserve.grammar.backends.base import apply_bitmask

RING = 4  # staging buffers; a step uses one (two when a grammar starts mid-step)


class MaskApplier:
    def __init__(self, bitmask: torch.Tensor, device: torch.device):
        self.bitmask = bitmask  # [max_rows, words] int32, host (shared memory)
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            rows, words = bitmask.shape
            self._staging = [torch.empty((rows, words + 1), dtype=torch.int32, pin_memory=True) for _ in range(RING)]
            self._copied: list[torch.cuda.Event | None] = [None] * RING
            self._masks = torch.empty((rows, words + 1), dtype=torch.int32, device=device)
            self._next = 0

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask `logits[rows[i]]` in place with bitmask row `rows[i]` (bitmask rows are indexed like logits rows)."""
        if not rows:
            return
        if self.cuda and logits.stride(-1) == 1:
            self._apply_cuda(logits, rows)
            return
        n = len(rows)
        if rows == list(range(n)):  # the first n rows (e.g. every row constrained): mask in place, no copies
            apply_bitmask(logits[:n], self.bitmask[:n].to(logits.device))
            return
        idx = torch.tensor(rows, dtype=torch.long)
        idx_dev = idx.to(logits.device)
        sub = logits[idx_dev]
        apply_bitmask(sub, self.bitmask[idx].to(logits.device))
        logits[idx_dev] = sub

    def _apply_cuda(self, logits: torch.Tensor, rows: list[int]) -> None:
        from gramserve.sampling.bitmask_kernel import apply_masks

        k = self._next
        self._next = (k + 1) % RING
        if self._copied[k] is not None:
            self._copied[k].synchronize()  # the copy that last read this buffer (RING uses ago) has run
        n = len(rows)
        staged = self._staging[k][:n]
        idx = torch.tensor(rows, dtype=torch.long)
        staged[:, 0] = idx
        # Every row constrained (the common case): a slice copy instead of a gather.
        staged[:, 1:] = self.bitmask[:n] if rows == list(range(n)) else self.bitmask[idx]
        masks = self._masks[:n]
        masks.copy_(staged, non_blocking=True)
        event = self._copied[k] or torch.cuda.Event()
        event.record()
        self._copied[k] = event
        apply_masks(logits, masks, covered=min(logits.shape[-1], self.bitmask.shape[1] * 32))
