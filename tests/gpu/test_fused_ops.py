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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_and_rope_store_match_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for n in (576, 4096):
        x = torch.randn(29, n, device="cuda", generator=g).to(dtype)
        res = torch.randn(29, n, device="cuda", generator=g).to(dtype)
        w = (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)
        want_res = x + res
        ref = _ref_rmsnorm(want_res, w, 1e-5)
        got = fused_ops.add_rmsnorm(x, res, w, 1e-5)
        assert torch.equal(res, want_res)  # the residual stream is updated in place, rounded as x + residual
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < tol
    for h, hk, d in ((9, 3, 64), (32, 8, 128)):
        t = 21
        qkv = torch.randn(t, (h + 2 * hk) * d, device="cuda", generator=g).to(dtype)
        cos = torch.randn(300, d // 2, device="cuda", generator=g)
        sin = torch.randn(300, d // 2, device="cuda", generator=g)
        pos = torch.randint(0, 300, (t,), device="cuda", generator=g)
        loc = torch.randperm(100, device="cuda", generator=g)[:t] + 1
        kc = torch.zeros(101, hk, d, dtype=dtype, device="cuda")
        vc = torch.zeros_like(kc)
        q_ref = fused_ops.rope(qkv[:, : h * d].view(t, h, d), cos, sin, pos)
        k_ref = fused_ops.rope(qkv[:, h * d : (h + hk) * d].view(t, hk, d), cos, sin, pos)
        q = fused_ops.rope_and_store(qkv, h, hk, cos, sin, pos, kc, vc, loc)
        assert torch.equal(q, q_ref)
        assert torch.equal(kc[loc], k_ref)
        assert torch.equal(vc[loc], qkv[:, (h + hk) * d :].view(t, hk, d))
        untouched = torch.ones(101, dtype=torch.bool, device="cuda")
        untouched[loc] = False
        assert not kc[untouched].any() and not vc[untouched].any()
