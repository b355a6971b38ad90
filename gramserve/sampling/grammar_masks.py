"""Grammar bitmasks onto the logits, on the logits' device.

The grammar worker writes one bitmask row per constrained request (its slot) into shared host memory;
`MaskApplier.apply(logits, pairs)` masks `logits[row]` with bitmask row `slot` for each (row, slot).

* CPU: one call of a C kernel over the (row, slot) pairs (`bitmask_cpu`), or `apply_bitmask` on the gathered
  rows where it cannot be built.
* CUDA: the shared bitmask is page-locked (`GrammarClient.attach`, before the applier is made), so the rows up to
  the highest slot in use go to the GPU in one asynchronous copy with no host-side copy; the (row, slot) pairs
  go through a small page-locked buffer, and only when they change (steady decode: never); one Triton kernel
  (`bitmask_kernel`) applies them and also disallows logits columns past the grammar's vocabulary. Nothing
  waits for the GPU. (Copying on a stream of its own, beside the forward, measured slower: by the time the
  masks exist the forward is mostly done, and the stream hand-offs cost host time on the critical path.)
  A slot is rewritten by the grammar worker only after the step that read it has sampled (the next fill
  needs that step's tokens), or, for a slot just handed to a new request, while only a finished request's
  discarded row could still read it. If the segment could not be page-locked, the rows are staged through a
  page-locked copy instead.
"""

from __future__ import annotations

import torch

from gramserve.sampling.bitmask import apply_bitmask
from gramserve.sampling.bitmask_cpu import apply_pairs

RING = 2  # page-locked buffers for the (row, slot) pairs; one is refilled while the other's copy may be queued


class MaskApplier:
    def __init__(self, bitmask: torch.Tensor, device: torch.device, pinned: bool = False):
        self.bitmask = bitmask  # [slots, words] int32, host (shared memory); `pinned`: page-locked
        self.device = device
        self.cuda = device.type == "cuda"
        self._cpu_pairs_of: list[tuple[int, int]] | None = None  # CPU: the pairs list last converted ...
        self._cpu_pairs = torch.empty((0, 2), dtype=torch.int32)  # ... and its tensor
        if self.cuda:
            slots, words = bitmask.shape
            self._staging = None if pinned else torch.empty((slots, words), dtype=torch.int32, pin_memory=True)
            self._pairs = [torch.empty((slots, 2), dtype=torch.int32, pin_memory=True) for _ in range(RING)]
            self._copied: list[torch.cuda.Event | None] = [None] * RING
            self._next = 0
            self._masks = torch.empty((slots, words), dtype=torch.int32, device=device)
            self._pairs_dev = torch.empty((slots, 2), dtype=torch.int32, device=device)
            # The pairs list of the last apply and its highest slot + 1. The same list object again (the scheduler
            # passes the grammar client's cached layout in steady decode): its pairs are still in `_pairs_dev`.
            self._last_pairs: list[tuple[int, int]] | None = None
            self._last_used = 0
            self._staged: torch.cuda.Event | None = None  # the last copy out of `_staging`

    def apply(self, logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        if self.cuda and logits.stride(-1) == 1:
            self._apply_cuda(logits, pairs)
            return
        if not self.cuda:
            if pairs is not self._cpu_pairs_of:  # steady decode passes the same list: converted once
                self._cpu_pairs_of, self._cpu_pairs = pairs, torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2)
            if apply_pairs(logits, self.bitmask, self._cpu_pairs):
                return
        n = len(pairs)
        rows = [r for r, _ in pairs]
        slots = [s for _, s in pairs]
        masks = self.bitmask[:n] if slots == list(range(n)) else self.bitmask[torch.tensor(slots)]
        masks = masks.to(logits.device)
        if rows == list(range(n)):  # the first n rows (e.g. every row constrained): mask in place
            apply_bitmask(logits[:n], masks)
            return
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits[idx]
        apply_bitmask(sub, masks)
        logits[idx] = sub

    def _apply_cuda(self, logits: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        from gramserve.sampling.bitmask_kernel import apply_masks

        n = len(pairs)
        if pairs is not self._last_pairs:
            k = self._next
            self._next = (k + 1) % RING
            if self._copied[k] is not None:
                self._copied[k].synchronize()  # the copy that last read this buffer has run (long done)
            self._last_pairs, self._last_used = pairs, max(s for _, s in pairs) + 1
            staged = self._pairs[k][:n]
            staged.copy_(torch.tensor(pairs, dtype=torch.int32))
            self._pairs_dev[:n].copy_(staged, non_blocking=True)
            event = self._copied[k] or torch.cuda.Event()
            event.record()
            self._copied[k] = event
        used = self._last_used
        source = self.bitmask[:used]
        if self._staging is not None:
            if self._staged is not None:
                self._staged.synchronize()  # one staging buffer: the last copy out of it has run
            source = self._staging[:used]
            source.copy_(self.bitmask[:used])
        self._masks[:used].copy_(source, non_blocking=True)
        if self._staging is not None:
            self._staged = self._staged or torch.cuda.Event()
            self._staged.record()
        apply_masks(logits, self._masks, self._pairs_dev[:n], covered=min(logits.shape[-1], self.bitmask.shape[1] * 32))
