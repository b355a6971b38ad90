"""The Triton kernel of fp8_linear.py: per-token FP8 quantization of an activation in one launch (CUDA only).

One program a row: a pass for the row's largest magnitude, then a pass that writes row / scale in e4m3 (a row of
the 8B's down_proj input is 28 KB, so the second read comes from cache). Matches `quantize_rows_torch` value for
value (tests/gpu/test_fp8.py); Triton's CPU interpreter rounds to e4m3 differently, so CPU tests check the torch
twin instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gramserve.model.fp8_linear import _MIN_SCALE, FP8, FP8_MAX


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, MIN_SCALE, FP8_MAX: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)  # IEEE division, as torch's
    tl.store(s_ptr + row, scale)
    q_row = q_ptr + row * stride_q
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous rows) -> (e4m3 [M, K], float32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(2048, triton.next_power_of_2(k))
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), _MIN_SCALE, FP8_MAX=FP8_MAX, BLOCK=block,
                                num_warps=4 if block >= 1024 else 2)  # fmt: skip
    return q, scale
