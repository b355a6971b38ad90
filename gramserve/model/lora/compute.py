"""y += scaling * B(A(x)) for each row's adapter, in torch: the CPU's segmented LoRA matmuls and the reference of
the GPU's Triton kernels (triton_ops.py, which LoRALinear uses on CUDA).

One pair of matmuls per segment: the shrink h = x A^T for every targeted module of the projection at once, then
one expand per module into its columns of y.
"""

from __future__ import annotations

import torch

from gramserve.model.lora.batch import LoRABatch
from gramserve.model.lora.pool import ProjectionPool


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, proj: ProjectionPool, batch: LoRABatch) -> None:
    """Add the adapters' share to a projection's output `y` [T, out] (in place) for its input `x` [T, in]."""
    r = proj.rank
    for start, length, slot in batch.segments:
        rows = slice(start, start + length)
        h = x[rows] @ proj.a[slot].t()  # [n, subs * R]
        for sub in proj.subs:
            b = proj.b[slot, sub.b_start : sub.b_start + (sub.out_end - sub.out_start)]
            y[rows, sub.out_start : sub.out_end] += h[:, sub.index * r : (sub.index + 1) * r] @ b.t()
