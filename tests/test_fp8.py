"""`--quantization fp8` on the CPU (the GPU path's twin): weight and activation quantization, the scaled GEMM against
the same arithmetic written out, a real model's logits against its float weights, and the server with it."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import torch.nn.functional as F

from gramserve.model import fp8_linear
from gramserve.model.fp8_linear import FP8_MAX, Fp8Linear, quantize_rows_torch, quantize_weight, use_fp8_weights
from gramserve.model.runner import ModelRunner, RunnerConfig


def test_weight_quantization_rounds_each_value_to_its_nearest_e4m3():
    torch.manual_seed(0)
    w = torch.randn(300, 96) * torch.logspace(-3, 1, 300).unsqueeze(1)  # rows of very different scales
    w[5] = 0.0
    w[9, 3] = 50.0  # an outlier sets its row's scale
    q, scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (300,)
    assert torch.equal(scale, (w.abs().amax(dim=1) / FP8_MAX).clamp(min=fp8_linear._MIN_SCALE))
    assert q.float().abs().amax() == FP8_MAX  # each row's largest value maps to e4m3's largest
    err = (q.float() * scale[:, None] - w).abs()
    # round to nearest: half a step of 3 mantissa bits (2^-4 of the value), or half the subnormal step (2^-10)
    assert (err <= w.abs() * 2**-4 + scale[:, None] * 2**-10 + 1e-12).all()
    assert not q[5].float().any()


def test_activation_quantization_is_per_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1000.0, 1.0, -3.0]])
    q, s = quantize_rows_torch(x)
    assert s.shape == (3, 1) and s[0, 0] == 2.0 / FP8_MAX and s[2, 0] == 1000.0 / FP8_MAX
    assert q[0].float().tolist() == [224.0, -448.0, 112.0]
    assert not q[1].float().any() and s[1, 0] > 0
    assert q[2, 0].float() == FP8_MAX


@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_fp8_linear_equals_the_arithmetic_written_out(bias):
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 48, bias=bias)
    fp8 = Fp8Linear.of(linear)
    assert fp8.weight.shape == (48, 64) and fp8.weight_scale.shape == (1, 48)
    x = torch.randn(2, 5, 64)  # 3-D input: the leading dims come back
    qx, sx = quantize_rows_torch(x.reshape(-1, 64))
    want = qx.double() * sx.double() @ (fp8.weight.double() * fp8.weight_scale.double().reshape(-1, 1)).T
    if bias:
        want = want + linear.bias.double()
    got = fp8(x)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.reshape(2, 5, 48), rtol=1e-5, atol=1e-5)
    assert float((got - linear(x)).norm() / linear(x).norm()) < 0.06  # FP8's rounding of both operands
    assert fp8(torch.empty(0, 64)).shape == (0, 48)


def test_projections_whose_sizes_do_not_fit_the_gemm_keep_floats(tmp_path):
    cfg = json.load(open("tests/data/tiny_llama.json"))
    cfg["intermediate_size"] = 100  # gate_up: 200 rows, down: 100 columns, not multiples of 16
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(cfg))
    runner = ModelRunner(RunnerConfig(model_path=str(path), load_format="dummy", kv_cache_memory_gb=0.01))
    swapped, kept = use_fp8_weights(runner.model)
    assert (swapped, kept) == (2 * cfg["num_hidden_layers"], 2 * cfg["num_hidden_layers"])
    layer = runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert not isinstance(layer.mlp.gate_up_proj, Fp8Linear) and not isinstance(layer.mlp.down_proj, Fp8Linear)


def test_gpu_checks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        fp8_linear.check_fp8_device(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        fp8_linear.check_fp8_device(torch.device("cuda"), torch.float16)
    fp8_linear.check_fp8_device(torch.device("cuda"), torch.bfloat16)


@torch.inference_mode()
def test_the_default_models_logits_stay_near_its_float_weights():
    """SmolLM2-135M's real weights: every projection in FP8 against float32. A model this small is sensitive to
    rounding (docs/quantization.md has the figures); the bounds catch a broken scale or layout, which gives
    unrelated logits."""
    from transformers import AutoTokenizer

    from tests.test_model_vs_hf import PROMPTS, Harness

    outs = {}
    for quant in ("none", "fp8"):
        runner = ModelRunner(RunnerConfig(kv_cache_memory_gb=0.1, max_running_requests=8, quantization=quant))
        tok = AutoTokenizer.from_pretrained(runner.model_dir)
        ids = [tok.encode(p) for p in PROMPTS]
        h = Harness(runner)
        outs[quant] = h.extend([h.pool.alloc() for _ in ids], [0] * len(ids), ids, all_logits=True)
    assert runner.info.quantization == "fp8" and runner.info.cpu_decode == "torch"
    assert isinstance(runner.model.layers[3].mlp.down_proj, Fp8Linear)
    a, b = outs["none"], outs["fp8"]
    cos = F.cosine_similarity(a, b, dim=-1)
    top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    assert float(cos.mean()) > 0.95 and top1 > 0.8, (float(cos.mean()), top1)


def test_a_server_with_fp8_weights_serves_structured_output(tmp_path):
    import httpx
    from conftest import start_server
    from openai import OpenAI

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    srv = start_server(str(tmp_path), "--model-path", "tests/data/tiny_llama.json", "--load-format", "dummy",
                       "--quantization", "fp8")  # fmt: skip
    try:
        assert httpx.get(f"{srv.base_url}/get_server_info").json()["runner"]["quantization"] == "fp8"
        client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="x")
        finished = 0
        for seed in range(3):
            r = client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": "A person as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
                temperature=1.0,
                seed=seed,
                max_tokens=300,
            )
            if r.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
                finished += 1
        assert finished >= 1
    finally:
        srv.stop()
