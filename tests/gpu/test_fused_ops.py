"""The fused CUDA kernels of the decoder (RMSNorm, RoPE, SiLU-mul) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gramserve.model import fused_ops


def _ref_rmsnorm(x, w, eps):
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for n in (64, 576, 4096):
        x = torch.randn(37, n, device="cuda", generator=g).to(dtype)
        w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)
        ref = _ref_rmsnorm(x, w, 1e-5)
        got = fused_ops.rmsnorm(x, w, 1e-5)
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < tol
    qkv = torch.randn(19, 12 * 128, device="cuda", generator=g).to(dtype)
    q = qkv[:, : 8 * 128].view(-1, 8, 128)  # a strided view, as in the model
    cos = torch.randn(300, 64, device="cuda", generator=g)
    sin = torch.randn(300, 64, device="cuda", generator=g)
    pos = torch.randint(0, 300, (19,), device="cuda", generator=g)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    x1, x2 = q.float().chunk(2, dim=-1)
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    got = fused_ops.rope(q, cos, sin, pos)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < tol
    gu = torch.randn(23, 2 * 1536, device="cuda", generator=g).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = fused_ops.silu_mul(gu)
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) < tol
