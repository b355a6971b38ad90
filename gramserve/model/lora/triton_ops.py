"""The GPU's segmented LoRA matmuls (Triton): shrink h = x A^T, then expand y += h B^T, per segment of rows.

One kernel serves both: program (n tile, m lane, segment) multiplies rows of its segment, in tiles of BLOCK_M rows
strided by the number of m lanes, by its segment's slot of the weights. A segment of no rows (a CUDA graph's padding)
or of slot -1 returns at once, so the grid can stay fixed for a graph. Weights are read once per segment and
tile, so a batch with few adapters reads each adapter's weights a few times, not once per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gramserve.model.lora.batch import BLOCK_M, LoRABatch
from gramserve.model.lora.pool import ProjectionPool


@triton.jit
def _segment_matmul_kernel(
    X, W, Y, STARTS, LENGTHS, SLOTS,
    N, K,
    stride_xm, stride_ws, stride_wn, stride_ym,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Y[rows, n] (+)= sum_k X[rows, k] * W[slot, n, k] for the rows of one segment."""
    pid_n, lane, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lanes = tl.num_programs(1)
    length = tl.load(LENGTHS + seg)
    slot = tl.load(SLOTS + seg)
    if length > 0 and slot >= 0:
        start = tl.load(STARTS + seg)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_base = W + slot.to(tl.int64) * stride_ws
        for m0 in range(lane * BLOCK_M, length, lanes * BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows = (start + offs_m).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(
                    X + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < length) & (offs_k[None, :] < K),
                    other=0.0,
                )
                w = tl.load(
                    w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
                    other=0.0,
                )
                acc += tl.dot(x, w)
            y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
            mask = (offs_m[:, None] < length) & (offs_n[None, :] < N)
            if ACCUMULATE:
                acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)


def segment_matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, batch: LoRABatch, accumulate: bool) -> None:
    """y[rows] (+)= x[rows] @ w[slot].T for each segment. x [T, K] and y [T, N] may be column slices (row-strided
    views); w [slots, N, K] may be a row slice of a pool tensor."""
    n, k = w.shape[1], w.shape[2]
    assert x.stride(1) == 1 and y.stride(1) == 1 and w.stride(2) == 1 and x.shape[1] == k and y.shape[1] == n
    block_n = 64 if n <= 64 else 128
    block_k = 16 if k <= 16 else (32 if k <= 32 else 64)
    grid = (triton.cdiv(n, block_n), batch.m_split, batch.slots.shape[0])
    _segment_matmul_kernel[grid](
        x, w, y, batch.starts, batch.lengths, batch.slots,
        n, k,
        x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )  # fmt: skip


def add_lora(y: torch.Tensor, x: torch.Tensor, proj: ProjectionPool, batch: LoRABatch) -> None:
    r = proj.rank
    h = torch.empty(x.shape[0], proj.a.shape[1], dtype=x.dtype, device=x.device)
    segment_matmul(x, proj.a, h, batch, accumulate=False)
    for sub in proj.subs:
        b = proj.b[:, sub.b_start : sub.b_start + (sub.out_end - sub.out_start)]
        segment_matmul(
            h[:, sub.index * r : (sub.index + 1) * r], b, y[:, sub.out_start : sub.out_end], batch, accumulate=True
        )
