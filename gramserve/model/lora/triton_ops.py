"""The GPU's segmented LoRA matmuls (Triton): shrink h = x A^T, then expand y += h B^T, per segment of rows.

Program (column tile, m lane, segment) multiplies rows of its segment, in blocks of BLOCK_M rows strided by the
number of m lanes, by the segment's adapter slot of the weights. A segment of no rows (a CUDA graph's padding) or
of slot -1 returns at once, so the grid can stay fixed for a graph. Each adapter's weight tiles are read once per
lane that has rows, not once per row. (Measured on H100 / H200, 8B shape: this beat a grid of row blocks that loop
over the segments overlapping them, which serialises the adapters of a block: 1.64-1.78x the base TPOT against
1.19-1.38x with 16 adapters at batch 64.)

- shrink: with few rows (decode), K (the projection's input, 4096-14336) is split across programs (at most 8
  splits), each writing its partial sums (fp32) to its own plane of `partial` [splits, T, n * R]: no atomics, and
  enough programs to fill the GPU when a single row's adapter must be read.
- expand: one launch for every targeted module of the projection (q, k and v together). A program sums the partial
  planes of its rows once and adds h B^T to four column tiles of its module's columns of y (one tile for batches
  under BLOCK_M tokens, where programs are few).

LoRALinear runs the shrink on a side stream while the base matmul runs (the two only share x), which hides most of
the shrink's launch and latency. benchmarks/bench_lora_kernels.py measured these choices (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gramserve.model.lora.batch import BLOCK_M, LoRABatch
from gramserve.model.lora.pool import ProjectionPool

SPLIT_K_CHUNK = 256  # input columns per shrink program when K is split
SPLIT_K_MAX_ROWS = 128  # batches of more tokens (prefill) do not split K: their rows give the parallelism


@triton.jit
def _shrink_kernel(
    X, A, P, STARTS, LENGTHS, SLOTS,
    N, K, K_CHUNK,
    stride_xm, stride_as, stride_an, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """P[split, rows, n] = sum over split's k of X[rows, k] * A[slot, n, k], for the rows of one segment."""
    pid0, lane, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lanes = tl.num_programs(1)
    length = tl.load(LENGTHS + seg)
    slot = tl.load(SLOTS + seg)
    if length > 0 and slot >= 0:
        n_tiles = tl.cdiv(N, BLOCK_N)
        pid_n, split = pid0 % n_tiles, pid0 // n_tiles
        k_lo = split * K_CHUNK
        k_hi = tl.minimum(k_lo + K_CHUNK, K)
        start = tl.load(STARTS + seg)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_base = A + slot.to(tl.int64) * stride_as
        for m0 in range(lane * BLOCK_M, length, lanes * BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows = (start + offs_m).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(
                    X + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < length) & (offs_k[None, :] < k_hi),
                    other=0.0,
                )
                a = tl.load(
                    a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_hi),
                    other=0.0,
                )
                acc += tl.dot(x, a)
            p_ptrs = P + split * stride_ps + rows[:, None] * stride_pm + offs_n[None, :]
            tl.store(p_ptrs, acc, mask=(offs_m[:, None] < length) & (offs_n[None, :] < N))


@triton.jit
def _expand_kernel(
    P, B, Y, STARTS, LENGTHS, SLOTS,
    SPLITS, R, TILES, GROUP,
    N0, N1, N2, OUT0, OUT1, OUT2, ROW0, ROW1, ROW2,
    stride_ps, stride_pm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Y[rows, OUT_s + n] += sum_k h[rows, s * R + k] * B[slot, ROW_s + n, k] for module s of the projection, where
    h is the sum of the partial planes P, for the rows of one segment and GROUP column tiles (h is summed once for
    them all)."""
    pid0, lane, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lanes = tl.num_programs(1)
    groups = tl.cdiv(TILES, GROUP)
    sub, first = pid0 // groups, (pid0 % groups) * GROUP
    n = tl.where(sub == 0, N0, tl.where(sub == 1, N1, N2))
    length = tl.load(LENGTHS + seg)
    slot = tl.load(SLOTS + seg)
    if length > 0 and slot >= 0 and first * BLOCK_N < n:
        out0 = tl.where(sub == 0, OUT0, tl.where(sub == 1, OUT1, OUT2))
        row0 = tl.where(sub == 0, ROW0, tl.where(sub == 1, ROW1, ROW2))
        start = tl.load(STARTS + seg)
        b_base = B + slot.to(tl.int64) * stride_bs + row0.to(tl.int64) * stride_bn
        offs_r = tl.arange(0, BLOCK_R)
        last = tl.minimum(first + GROUP, tl.cdiv(n, BLOCK_N))
        for m0 in range(lane * BLOCK_M, length, lanes * BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows = (start + offs_m).to(tl.int64)
            h_ptrs = P + rows[:, None] * stride_pm + (sub * R + offs_r)[None, :]
            h_mask = (offs_m[:, None] < length) & (offs_r[None, :] < R)
            h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in range(SPLITS):
                h += tl.load(h_ptrs + split * stride_ps, mask=h_mask, other=0.0)
            h = h.to(B.dtype.element_ty)
            for tile in range(first, last):
                offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                b = tl.load(
                    b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=(offs_n[None, :] < n) & (offs_r[:, None] < R),
                    other=0.0,
                )
                y_ptrs = Y + rows[:, None] * stride_ym + (out0 + offs_n)[None, :]
                mask = (offs_m[:, None] < length) & (offs_n[None, :] < n)
                acc = tl.dot(h, b) + tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the two kernels (benchmarks/bench_lora_kernels.py sweeps them)."""

    split_k_chunk: int = SPLIT_K_CHUNK
    max_splits: int = 8  # at most this many K splits (0: no limit); a longer K takes longer chunks
    split_k_max_rows: int = SPLIT_K_MAX_ROWS
    shrink_warps: int = 4
    shrink_block_k: int = 64
    shrink_stages: int = 3  # software pipelining depth of the shrink's loop over K
    expand_warps: int = 4
    expand_block_n: int = 128
    expand_group: int = 4  # column tiles per expand program, for batches of a row block or more


DEFAULT = KernelConfig()


def shrink(x: torch.Tensor, proj: ProjectionPool, batch: LoRABatch, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """The partial planes [splits, T, n * R] (fp32) of h = x A^T for each row's adapter (their sum is h)."""
    a = proj.a
    assert x.stride(1) == 1
    tokens, k, n = x.shape[0], a.shape[2], a.shape[1]
    splits = triton.cdiv(k, cfg.split_k_chunk) if tokens <= cfg.split_k_max_rows else 1
    if cfg.max_splits:
        splits = min(splits, cfg.max_splits)
    chunk = triton.cdiv(k, splits)
    partial = torch.empty(splits, tokens, n, dtype=torch.float32, device=x.device)
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    _shrink_kernel[(triton.cdiv(n, block_n) * splits, batch.m_split, batch.slots.shape[0])](
        x, a, partial, batch.starts, batch.lengths, batch.slots,
        n, k, chunk,
        x.stride(0), a.stride(0), a.stride(1), partial.stride(0), partial.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=cfg.shrink_block_k if chunk >= cfg.shrink_block_k else 16,
        num_warps=cfg.shrink_warps, num_stages=cfg.shrink_stages,
    )  # fmt: skip
    return partial


def expand(
    y: torch.Tensor, partial: torch.Tensor, proj: ProjectionPool, batch: LoRABatch, cfg: KernelConfig = DEFAULT
) -> None:
    """y += h B^T per targeted module of the projection, h being the sum of the partial planes."""
    r, b, subs = proj.rank, proj.b, proj.subs
    assert len(subs) <= 3 and y.stride(1) == 1
    widths = [s.out_end - s.out_start for s in subs] + [0] * (3 - len(subs))
    outs = [s.out_start for s in subs] + [0] * (3 - len(subs))
    rows = [s.b_start for s in subs] + [0] * (3 - len(subs))
    block_n = cfg.expand_block_n if max(widths) >= cfg.expand_block_n else 64
    tiles = triton.cdiv(max(widths), block_n)
    group = min(cfg.expand_group if y.shape[0] >= BLOCK_M else 1, tiles)
    _expand_kernel[(triton.cdiv(tiles, group) * len(subs), batch.m_split, batch.slots.shape[0])](
        partial, b, y, batch.starts, batch.lengths, batch.slots,
        partial.shape[0], r, tiles, group,
        *widths, *outs, *rows,
        partial.stride(0), partial.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(r)),
        num_warps=cfg.expand_warps,
    )  # fmt: skip


def add_lora(
    y: torch.Tensor, x: torch.Tensor, proj: ProjectionPool, batch: LoRABatch, cfg: KernelConfig = DEFAULT
) -> None:
    """y += the adapters' share, for a projection with up to three targeted modules."""
    expand(y, shrink(x, proj, batch, cfg), proj, batch, cfg)
