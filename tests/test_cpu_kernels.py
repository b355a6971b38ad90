"""The CPU decode kernels (gramserve/model/cpu_kernels.c) against torch, and the model with them against without.

Every kernel is checked against the torch code it replaces on random inputs; the GGUF blocks must reproduce the
converted float weights exactly; the default model's decode with the kernels must give HF's greedy tokens
(tests/test_model_vs_hf.py runs with them on) and logits within fp32 rounding of the torch path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gramserve.model import cpu_kernels
from gramserve.model.quant_weights import BlockWeight, quantize_q8_0

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason="CPU kernels cannot be built here (no AVX2/FMA or no compiler)")


HAS_AVX512 = lib is not None and cpu_kernels.use_avx512(lib)


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """Run the test on each instruction set the library dispatches to (AVX-512 where this CPU has it)."""
    if request.param == "avx512" and not HAS_AVX512:
        pytest.skip("this CPU has no AVX-512")
    cpu_kernels.use_avx512(lib, request.param == "avx512")
    yield request.param
    cpu_kernels.use_avx512(lib, True)


def random_blocks(bits: int, n: int, k: int, gen: torch.Generator) -> BlockWeight:
    nb = k // 32
    width = 16 if bits == 4 else 32
    qs = torch.randint(0, 256, (n, nb, width), dtype=torch.uint8, generator=gen)
    d = torch.rand(n, nb, generator=gen) * 0.01
    m = -torch.rand(n, nb, generator=gen) * 0.05 if bits == 4 else None
    return BlockWeight(bits, qs, d, m)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 13, 20])
@pytest.mark.parametrize("threads", [1, 2])
def test_qgemm_matches_the_dequantized_matmul(bits, rows, threads, isa):
    gen = torch.Generator().manual_seed(rows * 10 + bits)
    blocks = random_blocks(bits, 37, 96, gen)
    x = torch.randn(rows, 96, generator=gen)
    ref = x @ blocks.dequantize().T
    out = cpu_kernels.qgemm(lib, x, bits, blocks.qs, blocks.d, blocks.m, 37, threads)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_qgemm_refuses_a_width_that_is_not_whole_blocks():
    blocks = random_blocks(8, 4, 64, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        cpu_kernels.qgemm(lib, torch.randn(1, 48), 8, blocks.qs, blocks.d, None, 4, 1)


def test_q8_0_rounding_is_within_half_a_step():
    w = torch.randn(64, 128)
    blocks = quantize_q8_0(w)
    step = blocks.d.repeat_interleave(32, dim=1)
    assert ((blocks.dequantize() - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,width", [(5, 576), (2, 100), (70, 576)])  # 70: on the OpenMP team
def test_rmsnorm(with_residual, rows, width):
    x, w = torch.randn(rows, width), torch.rand(width) + 0.5
    residual = torch.randn(rows, width) if with_residual else None
    total = x + residual if with_residual else x
    ref = w * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))
    res_arg = residual.clone() if with_residual else None
    out = cpu_kernels.rmsnorm(lib, x, w, 1e-5, res_arg)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if with_residual:
        torch.testing.assert_close(res_arg, total)  # the sum is left in the residual stream


@pytest.mark.parametrize("rows", [3, 16, 70])
def test_silu_mul(rows):
    gu = torch.randn(rows, 2 * 1536) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(lib, gu), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [5, 70])  # 70 rows: on the OpenMP team
def test_rope_store_matches_the_torch_rope_and_fills_the_cache(t):
    from gramserve.model.llama import RotaryEmbedding
    from gramserve.model.model_config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "vocab_size": 100,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
        }
    )
    rope = RotaryEmbedding(cfg, 64)
    hq, hkv, d = 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    positions = torch.tensor([0, 3, 7, 8, 63] * (t // 5))
    loc = torch.randperm(t + 5)[:t]
    k_cache, v_cache = torch.zeros(t + 5, hkv, d), torch.zeros(t + 5, hkv, d)
    q = cpu_kernels.rope_and_store(lib, qkv, hq, hkv, rope.cos, rope.sin, positions, k_cache, v_cache, loc)
    q_ref, k_ref, v_ref = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    assert torch.equal(q, rope(positions, q_ref.reshape(t, hq, d)))  # same arithmetic, same bits
    assert torch.equal(k_cache[loc], rope(positions, k_ref.reshape(t, hkv, d)))
    assert torch.equal(v_cache[loc], v_ref.reshape(t, hkv, d))


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (8, 1, 64), (4, 2, 128), (6, 2, 32)])
def test_decode_attention_matches_sdpa_over_the_gathered_slots(hq, hkv, d, isa):
    gen = torch.Generator().manual_seed(hq * 7 + hkv)
    # 1,500 rows: past the AVX-512 path's stack buffer for the scores (its heap fallback)
    slots, max_len = 1600, 1500
    k_cache, v_cache = torch.randn(slots, hkv, d, generator=gen), torch.randn(slots, hkv, d, generator=gen)
    lens = torch.tensor([1, 17, 1500])
    table = torch.zeros(4, max_len, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    for r, n in zip(rows.tolist(), lens.tolist()):
        table[r, :n] = torch.randperm(slots - 1, generator=gen)[:n].to(torch.int32) + 1
    q = torch.randn(3, hq, d, generator=gen)
    out = cpu_kernels.decode_attention(lib, q, k_cache, v_cache, table, rows, lens, d**-0.5, 2)
    for i, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        idx = table[r, :n].long()
        keys, values = k_cache[idx].transpose(0, 1)[None], v_cache[idx].transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[i][None, :, None], keys, values, scale=d**-0.5, enable_gqa=True)
        torch.testing.assert_close(out[i], ref.reshape(-1), atol=1e-5, rtol=1e-4)


# --- the default model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runners():
    from gramserve.model.runner import ModelRunner, RunnerConfig

    kernels = ModelRunner(RunnerConfig(kv_cache_memory_gb=0.1, max_running_requests=4, cpu_kernel_threads=2))
    with pytest.MonkeyPatch.context() as mp:  # as on a machine where the kernels cannot be built
        mp.setattr(cpu_kernels, "load", lambda: None)
        plain = ModelRunner(RunnerConfig(kv_cache_memory_gb=0.1, max_running_requests=4))
    return kernels, plain


def test_gguf_blocks_reproduce_the_converted_weights(runners):
    kernels, _ = runners
    assert kernels.info.cpu_decode == "kernels+gguf"
    weights = kernels.model.hf_weights()
    from gramserve.model.block_linear import BlockLinear

    linears = [m for m in kernels.model.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 4 * kernels.config.num_layers + 1  # every projection and the (tied) lm_head
    for lin in linears:
        assert torch.equal(lin.blocks.dequantize(), lin.weight), "blocks must be the same weight values"
    assert "model.embed_tokens.weight" in weights


@torch.inference_mode()
def test_decode_with_kernels_matches_the_torch_path(runners):
    from test_model_vs_hf import Harness

    kernels, plain = runners
    assert plain.info.cpu_decode == "torch"
    # Five rows: the kernels' batch path (4 rows or more) as well as the few-row one (the HF tests).
    prompts = [[1, 504, 3458, 314, 253], [9690, 198, 30, 12, 1205, 3021, 28, 7, 99, 13], [42, 7, 1000], [5] * 9, [77]]
    outs = []
    for runner in (kernels, plain):
        h = Harness(runner)
        rows = [h.pool.alloc() for _ in prompts]
        logits = h.extend(rows, [0] * len(prompts), prompts)
        steps, lens, tokens = [logits], [len(p) for p in prompts], logits.argmax(-1).tolist()
        for _ in range(12):
            logits = h.decode(rows, lens, tokens)
            lens, tokens = [n + 1 for n in lens], logits.argmax(-1).tolist()
            steps.append(logits)
        outs.append(steps)
    for ours, ref in zip(*outs):
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 4, 16])  # the few-row, tile and panel matmuls
def test_decode_layers_in_one_call_equal_the_per_layer_path(runners, rows):
    """gs_decode_layers runs the per-layer path's kernels in its order: the logits are the same bit for bit."""
    from test_model_vs_hf import Harness

    kernels, _ = runners
    model = kernels.model
    one_call = model.decode_layers
    assert one_call is not None and one_call.max_rows >= 4
    calls = []

    class Counted:
        applies = one_call.applies

        def __call__(self, *args):
            calls.append(len(args))
            return one_call(*args)

    h = Harness(kernels)
    pool_rows = [h.pool.alloc() for _ in range(rows)]
    prompts = [[1, 504, 3458, 314, 253, 9690, 198][: 3 + i] for i in range(rows)]
    first = h.extend(pool_rows, [0] * rows, prompts).argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    try:
        model.decode_layers = Counted()
        fused = h.decode(pool_rows, lens, first)
        assert calls, "the decode step did not take the one-call path"
        model.decode_layers = None
        per_layer = h.decode(pool_rows, lens, first)  # the same step again (new slots, the same inputs and KV)
    finally:
        model.decode_layers = one_call
    assert torch.equal(fused, per_layer)


def test_a_dropped_runner_frees_its_model_at_once():
    """No reference cycle through the model (the one-call decode once held it): the memory of a runner that is
    dropped comes back without waiting for the garbage collector (the test suite builds dozens of runners)."""
    import weakref

    from gramserve.model.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(kv_cache_memory_gb=0.1, max_running_requests=2, cpu_kernel_threads=2))
    assert runner.model.decode_layers is not None
    model = weakref.ref(runner.model)
    del runner
    assert model() is None


@torch.inference_mode()
def test_q8_0_weights_stay_close_to_the_float_model(runners):
    """--cpu-weights q8_0 rounds every projection to 8-bit blocks: a documented tolerance, not equality."""
    from test_model_vs_hf import Harness

    from gramserve.model.runner import ModelRunner, RunnerConfig

    _, plain = runners
    q8 = ModelRunner(RunnerConfig(kv_cache_memory_gb=0.1, max_running_requests=4, cpu_weights="q8_0"))
    assert q8.info.cpu_decode == "kernels+q8_0"
    prompt = [1, 504, 3458, 314, 253, 9690, 198, 30]
    logits = []
    for runner in (q8, plain):
        h = Harness(runner)
        row = h.pool.alloc()
        h.extend([row], [0], [prompt])
        logits.append(h.decode([row], [len(prompt)], [prompt[-1]])[0])
    ours, ref = logits
    assert ours.argmax() == ref.argmax()
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
