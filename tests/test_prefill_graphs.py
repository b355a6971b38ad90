"""The prefill steps' pieces (model/prefill_graphs.py) against the plain forward, on the CPU.

The GPU replays each piece as a CUDA graph (tests/gpu/test_gpu_backends.py); here the same pieces run as plain
calls over the same static buffers and padding, so that what the graphs would capture (the cut at each attention
call, the residual stream across pieces, padding rows writing to scratch slot 0) is checked in CI.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from gramserve.model.prefill_graphs import PrefillGraphRunner, token_buckets
from tests.gpu.harness import make_runner

TINY = json.load(open("tests/data/tiny_llama.json"))
QWEN3 = {**TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}  # q/k norms: k, v not stored early


def test_token_buckets_cover_every_count_up_to_the_max():
    assert token_buckets(0) == []
    assert token_buckets(512)[:5] == [8, 16, 32, 48, 64] and token_buckets(512)[-1] == 512
    assert token_buckets(100)[-1] == 100
    sizes = token_buckets(2000)
    assert sizes[-1] == 2000 and sizes == sorted(set(sizes))
    assert all(b <= a * 1.5 for a, b in zip(sizes[3:], sizes[4:]))  # padding stays under half a step


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_pieces_match_the_plain_forward(family, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY if family == "llama" else QWEN3))
    kw = dict(dtype="float32", device="cpu", max_reqs=16, kv_gb=0.02)
    plain_runner, plain = make_runner(str(path), "torch", **kw)
    runner, pieced = make_runner(str(path), "torch", **kw)
    runner.prefill_graphs = PrefillGraphRunner(runner.model, runner.backend, 64, graphs=False)
    assert runner.model.layers[0].self_attn.q_norm is not None or family == "llama"
    rng = random.Random(0)
    rows, used = list(range(12)), 0
    for step in range(8):
        # A few requests a step: new ones, and earlier ones extended over their cached tokens.
        batch_rows = sorted(rng.sample(rows, rng.randint(1, 4)))
        new_ids = [[rng.randrange(49152) for _ in range(rng.randint(1, 15))] for _ in batch_rows]
        all_logits = step % 3 == 2
        want = plain.extend(batch_rows, new_ids, all_logits=all_logits)
        got = pieced.extend(batch_rows, new_ids, all_logits=all_logits)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        used += sum(map(len, new_ids))
    # Decode steps over the pieces' KV cache agree too: the pieces wrote every real token's K/V where the plain
    # forward did, and padding rows only to scratch slot 0.
    cache, ref = runner.kv_cache, plain_runner.kv_cache
    for layer in range(len(cache.k)):
        torch.testing.assert_close(cache.k[layer][1 : used + 1], ref.k[layer][1 : used + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v[layer][1 : used + 1], ref.v[layer][1 : used + 1], atol=1e-5, rtol=1e-5)
    decode_rows = [r for r in rows if r in plain.lens]
    tokens = [rng.randrange(49152) for _ in decode_rows]
    torch.testing.assert_close(pieced.decode(decode_rows, tokens), plain.decode(decode_rows, tokens))


def test_batches_the_pieces_do_not_take_run_the_plain_forward(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    runner, harness = make_runner(str(path), "torch", dtype="float32", device="cpu", max_reqs=4, kv_gb=0.02)
    pieces = runner.prefill_graphs = PrefillGraphRunner(runner.model, runner.backend, 16, graphs=False)
    calls = []
    original = pieces.run
    pieces.run = lambda batch: calls.append(batch.input_ids.shape[0]) or original(batch)
    harness.extend([0], [list(range(100, 110))])  # 10 tokens: pieces
    harness.extend([1], [list(range(100, 130))])  # 30 tokens: past the largest size, plain forward
    harness.decode([0, 1], [5, 6])  # decode: not a prefill step
    assert calls == [10]
