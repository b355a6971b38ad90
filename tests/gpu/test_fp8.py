"""`--quantization fp8` on the GPU: the Triton activation quantizer against its torch twin, the scaled GEMM against
the same arithmetic in float32, and a runner with FP8 projections under CUDA graphs against the same runner eager
and against bf16 weights."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F

from gramserve.model.fp8_kernels import quantize_rows_triton
from gramserve.model.fp8_linear import Fp8Linear, quantize_rows_torch
from tests.gpu.conftest import write_config
from tests.gpu.harness import SMALL_GQA, make_runner, rel_err
from tests.gpu.test_gpu_backends import scenario

pytestmark = pytest.mark.skipif(
    torch.cuda.get_device_capability() < (9, 0), reason="FP8 GEMMs with row scales need compute capability 9.0"
)
BACKEND = "flashinfer_triton" if importlib.util.find_spec("flashinfer") else "triton"


@pytest.mark.parametrize("shape", [(1, 4096), (3, 1024), (1000, 4096), (37, 14336), (8192, 576)])
def test_triton_quantizer_matches_torch(shape):
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    x[0, 7] = 300.0  # an outlier feature, as real activations have
    if shape[0] > 2:
        x[2] = 0  # an all-zero row (padding rows of a CUDA graph)
    q, s = quantize_rows_triton(x)
    q_ref, s_ref = quantize_rows_torch(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 64, 1024])
def test_fp8_linear_matches_dequantized_matmul(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear.of(linear)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    qx, sx = quantize_rows_torch(x)
    want = F.linear(qx.float() * sx, fp8.weight.float() * fp8.weight_scale.reshape(-1, 1))
    got = fp8(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 6144)
    assert rel_err(got, want) < 5e-3  # the bf16 output's rounding
    assert rel_err(got, linear(x)) < 0.06  # FP8's own rounding of both operands


@pytest.fixture(scope="module")
def gqa_config(config_dir):
    return write_config(config_dir, "small-gqa-fp8", SMALL_GQA)


def test_fp8_runner_graphs_match_eager_and_stay_near_bf16(gqa_config):
    """Prefill, extend over a cached prefix and decode at batch 64: FP8 under decode and prefill graphs equals FP8
    eager (the same kernels), and stays within FP8's rounding of the bf16 model on the same seeded weights."""
    outs = {}
    for name, quant, graphs in (("bf16", "none", False), ("fp8", "fp8", False), ("fp8 graphs", "fp8", True)):
        runner, harness = make_runner(
            gqa_config, BACKEND, graphs=graphs, max_reqs=128, prefill_graph_tokens=256 if graphs else 0,
            quantization=quant,
        )  # fmt: skip
        outs[name] = scenario(harness, 64, seed=5)
        if quant == "fp8":
            assert runner.info.quantization == "fp8"
            assert runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        del runner, harness
        torch.cuda.empty_cache()
    graphs_err = max(rel_err(a, b) for a, b in zip(outs["fp8 graphs"], outs["fp8"]))
    quant_err = max(rel_err(a, b) for a, b in zip(outs["fp8"], outs["bf16"]))
    top1 = [float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(outs["fp8"], outs["bf16"])]
    print(f"fp8 graphs vs eager {graphs_err:.2e}; fp8 vs bf16 {quant_err:.3f}, top-1 agreement {min(top1):.2f}")
    assert graphs_err < 1e-2
    assert quant_err < 0.15


def test_fp8_greedy_decode_runs_long(gqa_config):
    """Many decode steps at mixed batch sizes through the graphs: no NaN or inf in any logits."""
    runner, harness = make_runner(gqa_config, BACKEND, graphs=True, max_reqs=128, quantization="fp8")
    rng = random.Random(1)
    vocab = runner.config.vocab_size
    rows = list(range(100))
    logits = harness.extend(rows, [[rng.randrange(vocab) for _ in range(rng.randint(1, 200))] for _ in rows])
    for step in range(40):
        live = rows[: 100 - 2 * step]
        logits = harness.decode(live, logits[: len(live)].argmax(-1).tolist())
        assert torch.isfinite(logits).all()
