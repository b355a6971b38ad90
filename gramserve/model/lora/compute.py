"""y += scaling * B(A(x)) for each row's adapter: the segmented LoRA matmuls of one projection.

On a CPU (and as the GPU kernel's reference) one pair of matmuls per segment; on CUDA the Triton kernels of
triton_ops.py, which also run inside CUDA graphs (their segment tables are the graph's static inputs).
"""

from __future__ import annotations

import torch

from gramserve.model.lora.batch import LoRABatch
from gramserve.model.lora.pool import ProjectionPool


def add_lora(y: torch.Tensor, x: torch.Tensor, proj: ProjectionPool, batch: LoRABatch) -> torch.Tensor:
    """Add the adapters' share to a projection's output `y` [T, out] (in place) for its input `x` [T, in]."""
    if y.is_cuda:
        from gramserve.model.lora import triton_ops

        triton_ops.add_lora(y, x, proj, batch)
    else:
        add_lora_torch(y, x, proj, batch)
    return y


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, proj: ProjectionPool, batch: LoRABatch) -> None:
    r = proj.rank
    for start, length, slot in batch.segments:
        rows = slice(start, start + length)
        h = x[rows] @ proj.a[slot].t()  # [n, subs * R]
        for sub in proj.subs:
            b = proj.b[slot, sub.b_start : sub.b_start + (sub.out_end - sub.out_start)]
            y[rows, sub.out_start : sub.out_end] += h[:, sub.index * r : (sub.index + 1) * r] @ b.t()
