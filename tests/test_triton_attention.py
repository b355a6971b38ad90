"""Our Triton attention kernels run through Triton's interpreter on CPU tensors, against attention written out in
torch: decode with one KV split (the split kernel writes the output) and with several (merged by log-sum-exp,
some of them past the end of a sequence), and extend over a cached prefix. tests/gpu/test_gpu_backends.py runs
them on a GPU inside the model."""

from __future__ import annotations

import textwrap

from conftest import run_in_triton_interpreter

CHECK = textwrap.dedent("""
    import torch
    from gramserve.model.attention.triton_kernels import decode_attention, extend_attention

    def reference(q, k_buf, v_buf, slots, scale, causal_offset=None):
        # q: [T, Hq, D] against the K/V at `slots`; row t sees slots[: causal_offset + t + 1] when causal.
        group = q.shape[1] // k_buf.shape[1]
        k = k_buf[slots].repeat_interleave(group, dim=1).float()
        v = v_buf[slots].repeat_interleave(group, dim=1).float()
        s = torch.einsum("thd,nhd->htn", q.float(), k) * scale
        if causal_offset is not None:
            t, n = torch.arange(q.shape[0])[:, None], torch.arange(len(slots))[None, :]
            s = s.masked_fill(n > causal_offset + t, float("-inf"))
        return torch.einsum("htn,nhd->thd", s.softmax(-1), v)

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, slots_total = 8, 2, 16, 600
    k_buf = torch.randn(slots_total, hkv, d, generator=g)
    v_buf = torch.randn(slots_total, hkv, d, generator=g)
    table = torch.randperm(slots_total, generator=g)[:4 * 150].view(4, 150).to(torch.int32)
    scale = d ** -0.5
    rows = torch.tensor([2, 0, 3])
    seq_lens = torch.tensor([150, 1, 77])
    q = torch.randn(3, hq, d, generator=g)
    for splits in (1, 4, 16):  # 16: most splits past the end of every sequence (whole tiles per split)
        out = torch.zeros_like(q)
        decode_attention(q, k_buf, v_buf, out, table, rows, seq_lens, scale, splits)
        for b in range(3):
            want = reference(q[b:b + 1], k_buf, v_buf, table[rows[b], :seq_lens[b]].long(), scale)[0]
            err = (out[b] - want).abs().max().item()
            assert err < 1e-4, (splits, b, err)
    # extend: request 1 has 40 cached tokens and 30 new ones, request 0 none cached and 5 new.
    prefix, new = torch.tensor([40, 0], dtype=torch.int32), torch.tensor([30, 5], dtype=torch.int32)
    rows = torch.tensor([1, 0])
    q = torch.randn(35, hq, d, generator=g)
    out = torch.zeros_like(q)
    qo_start = torch.tensor([0, 30], dtype=torch.int32)
    extend_attention(q, k_buf, v_buf, out, table, rows, qo_start, prefix, new, 30, scale)
    for i, (start, p, n) in enumerate(((0, 40, 30), (30, 0, 5))):
        slots = table[rows[i], :p + n].long()
        want = reference(q[start:start + n], k_buf, v_buf, slots, scale, causal_offset=p)
        err = (out[start:start + n] - want).abs().max().item()
        assert err < 1e-4, ("extend", i, err)
    print("ok")
""")


def test_triton_attention_kernels_in_the_interpreter():
    run_in_triton_interpreter(CHECK)
