"""Our Triton kernels for attention over the paged KV pool (slot-indexed K/V buffers + req_to_token table).

* `extend_attention`: one program per (request, query head, block of new tokens); walks the request's
  prefix + new KV slots through req_to_token with an online softmax and a causal mask offset by the prefix.
* `decode_attention`: split-KV ("flash decoding"): one program per (request, KV head, split) handles all the
  query heads of its GQA group with one matrix product per KV block; a second kernel merges the splits by
  their log-sum-exp (with one split, the split kernel writes the output itself). Grid sizes depend only on the
  batch size, so decode can be captured in a CUDA graph.
fp32 inputs use IEEE fp32 products (no tf32), so float32 runs match the torch backend closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    O,
    table,
    table_stride,
    rows,
    qo_start,
    prefix_lens,
    new_lens,
    scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    new = tl.load(new_lens + b)
    if mb * BLOCK_M >= new:
        return
    prefix = tl.load(prefix_lens + b)
    q0 = tl.load(qo_start + b)
    row = tl.load(rows + b).to(tl.int64)
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_valid = offs_m < new
    q = tl.load(
        Q + (q0 + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )
    q_pos = prefix + offs_m
    kv_end = prefix + tl.minimum((mb + 1) * BLOCK_M, new)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        slots = tl.load(table + row * table_stride + offs_n, mask=n_valid, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=n_valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        allowed = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=n_valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        O + (q0 + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=m_valid[:, None],
    )


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    Mid,
    Lse,
    O,
    table,
    table_stride,
    rows,
    seq_lens,
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # Whole tiles per split: a short sequence keeps to its first splits (the rest find no tokens and write an
    # empty part), so the split count, fixed per batch size for the CUDA graphs, can be sized for long sequences.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    h_valid = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=h_valid[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        slots = tl.load(table + row * table_stride + offs_n, mask=n_valid, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=n_valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=n_valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if NUM_SPLITS == 1:  # the whole sequence in one program: its result is final, no merge
        o_ptr = O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=h_valid[:, None])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        mid_row = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [B, Hq, NUM_SPLITS]
        tl.store(Mid + mid_row[:, None] * D + offs_d[None, :], out, mask=h_valid[:, None])
        tl.store(Lse + mid_row, lse, mask=h_valid)


@triton.jit
def _decode_merge_kernel(
    Mid, Lse, O, stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * tl.num_programs(1) + h) * NUM_SPLITS
    offs_s = tl.arange(0, SPLITS_P2)
    s_valid = offs_s < NUM_SPLITS
    lse = tl.load(Lse + base + offs_s, mask=s_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_valid & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    offs_d = tl.arange(0, D)
    parts = tl.load(Mid + (base + offs_s)[:, None] * D + offs_d[None, :], mask=s_valid[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


def extend_attention(
    q, k_buf, v_buf, out, req_to_token, rows, qo_start, prefix_lens, new_lens, max_new: int, scale: float
) -> None:
    """q/out: [T, Hq, D]; k_buf/v_buf: [slots, Hkv, D]; per-request int tensors on the GPU."""
    bs, hq, d = rows.numel(), q.shape[1], q.shape[2]
    group = hq // k_buf.shape[1]
    ieee = q.dtype == torch.float32
    block_m, block_n = (32, 32) if ieee or d > 128 else (64, 64)
    grid = (bs, hq, triton.cdiv(max_new, block_m))
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_to_token.stride(0),
        rows,
        qo_start,
        prefix_lens,
        new_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=ieee,
        num_warps=4,
        num_stages=2,
    )


MAX_DECODE_SPLITS = 64


def decode_splits(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """KV splits per (request, KV head): enough programs to fill the GPU twice over, at most MAX_DECODE_SPLITS.
    A split covers whole tiles, so a sequence shorter than splits x tile uses only some of them."""
    want = max(1, (2 * num_sms) // max(1, batch_size * num_kv_heads))
    return min(MAX_DECODE_SPLITS, triton.next_power_of_2(want))


def decode_tile(programs: int, ieee: bool) -> tuple[int, int]:
    """(KV tokens per tile, warps) of the decode kernel for a grid of `programs` (request, KV head) programs.
    On an H100 (benchmarks/bench_decode_kernel.py, 72 tile / warp / stage / split variants per shape): from 1,024
    programs on (batch 128 at 8 KV heads), 32-token tiles on 2 warps came within 0.5% of the fastest variant,
    where 4 warps were up to 5% slower (batch 256: 245 vs 232 us); below, 64-token tiles on 4 warps."""
    if ieee:
        return 32, 4
    return (32, 2) if programs >= 1024 else (64, 4)


def decode_attention(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, scale: float, num_splits: int) -> None:
    """q/out: [B, Hq, D]; one new token per request whose K/V are already stored."""
    bs, hq, d = q.shape
    hkv = k_buf.shape[1]
    group = hq // hkv
    ieee = q.dtype == torch.float32
    block_n, warps = decode_tile(bs * hkv, ieee)
    if num_splits == 1:  # the split kernel writes `out` itself (mid / lse unused)
        mid = lse = out
    else:
        mid = torch.empty((bs, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bs, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(bs, hkv, num_splits)](
        q,
        k_buf,
        v_buf,
        mid,
        lse,
        out,
        req_to_token,
        req_to_token.stride(0),
        rows,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        D=d,
        BLOCK_N=block_n,
        IEEE=ieee,
        num_warps=warps,
        num_stages=2,
    )
    if num_splits == 1:
        return
    _decode_merge_kernel[(bs, hq)](
        mid,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
        D=d,
        num_warps=4,
    )
