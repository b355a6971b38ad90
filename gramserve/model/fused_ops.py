"""Fused Triton kernels for the decoder's small ops on CUDA: RMSNorm (alone and with the residual add), RoPE on
q and k together with the K/V cache store, SiLU-and-multiply.

Each replaces several elementwise torch kernels with one (per layer ~45 launches become ~11), which matters
most at small decode batches where every launch is a few microseconds of an otherwise memory-bound step.
Numerics follow the torch versions in `llama.py` (fp32 math, rounding to the model dtype at the same places).
Imported only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(W + offs, mask=m, other=0.0)
    y = (x * rstd).to(W.dtype.element_ty) * w
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=m)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] (last dim contiguous) -> same shape."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            weight,
            y,
            x2.stride(0),
            y.stride(0),
            shape[-1],
            eps,
            BLOCK=triton.next_power_of_2(shape[-1]),
            num_warps=4 if shape[-1] <= 4096 else 8,
        )
    return y.view(shape)


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    r = tl.load(R + row * stride_r + offs, mask=m, other=0.0)
    s = x + r  # in the model dtype, rounded as the unfused `x + residual` is
    tl.store(R + row * stride_r + offs, s, mask=m)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, 0) / n + eps)
    w = tl.load(W + offs, mask=m, other=0.0)
    y = (sf * rstd).to(W.dtype.element_ty) * w
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rmsnorm(residual). x, residual [T, n] with contiguous rows."""
    t, n = residual.shape
    assert x.shape == residual.shape and x.stride(-1) == 1 and residual.stride(-1) == 1
    y = torch.empty_like(residual)
    if t:
        _add_rmsnorm_kernel[(t,)](
            x,
            residual,
            weight,
            y,
            x.stride(0),
            residual.stride(0),
            y.stride(0),
            n,
            eps,
            BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8,
        )
    return y


@triton.jit
def _rope_store_kernel(
    QKV,
    stride_t,
    COS,
    SIN,
    POS,
    LOC,
    Q,
    stride_qt,
    KC,
    VC,
    stride_kc,
    stride_vc,
    H: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(POS + t).to(tl.int64)
    loc = tl.load(LOC + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(COS + pos * HALF + offs_d)[None, :]
    sin = tl.load(SIN + pos * HALF + offs_d)[None, :]
    row = QKV + t * stride_t
    # q heads: rotated into Q
    offs_h = tl.arange(0, BLOCK_H)
    mh = offs_h < H
    src = row + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(src, mask=mh[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mh[:, None], other=0.0).to(tl.float32)
    dst = Q + t * stride_qt + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(Q.dtype.element_ty), mask=mh[:, None])
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(Q.dtype.element_ty), mask=mh[:, None])
    # k heads: rotated straight into the cache slot; v heads: copied
    offs_k = tl.arange(0, BLOCK_HK)
    mk = offs_k < HK
    src = row + H * 2 * HALF + offs_k[:, None] * (2 * HALF) + offs_d[None, :]
    k1 = tl.load(src, mask=mk[:, None], other=0.0).to(tl.float32)
    k2 = tl.load(src + HALF, mask=mk[:, None], other=0.0).to(tl.float32)
    dst = KC + loc * stride_kc + offs_k[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, (k1 * cos - k2 * sin).to(KC.dtype.element_ty), mask=mk[:, None])
    tl.store(dst + HALF, (k2 * cos + k1 * sin).to(KC.dtype.element_ty), mask=mk[:, None])
    src = row + (H + HK) * 2 * HALF + offs_k[:, None] * (2 * HALF) + offs_d[None, :]
    dst = VC + loc * stride_vc + offs_k[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=mk[:, None]), mask=mk[:, None])
    tl.store(dst + HALF, tl.load(src + HALF, mask=mk[:, None]), mask=mk[:, None])


def rope_and_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """qkv [T, (H + 2 Hk) D] -> rotated q [T, H, D]; rotated k and v written to k_cache/v_cache[loc]
    ([slots, Hk, D])."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    assert qkv.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_store_kernel[(t,)](
            qkv,
            qkv.stride(0),
            cos,
            sin,
            positions,
            loc,
            q,
            q.stride(0),
            k_cache,
            v_cache,
            k_cache.stride(0),
            v_cache.stride(0),
            H=num_heads,
            HK=num_kv_heads,
            HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            num_warps=4,
        )
    return q


@triton.jit
def _rope_kernel(
    X,
    COS,
    SIN,
    POS,
    stride_t,
    stride_h,
    OUT,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(POS + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mh = offs_h < H
    cos = tl.load(COS + pos * HALF + offs_d)[None, :]
    sin = tl.load(SIN + pos * HALF + offs_d)[None, :]
    base = X + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mh[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mh[:, None], other=0.0).to(tl.float32)
    obase = OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(obase, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mh[:, None])
    tl.store(obase + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mh[:, None])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, H, D] (any token/head strides, last dim contiguous); cos/sin [P, D/2] fp32."""
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t,)](
            x,
            cos,
            sin,
            positions,
            x.stride(0),
            x.stride(1),
            out,
            out.stride(0),
            out.stride(1),
            H=h,
            HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(h),
            num_warps=4,
        )
    return out


@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n + offs, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Y + row * stride_y + offs, s * u, mask=m)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2n] = [gate | up] -> silu(gate) * up, [T, n]."""
    t, n2 = x.shape
    n = n2 // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](x, y, x.stride(0), y.stride(0), n, BLOCK=block, num_warps=4)
    return y
