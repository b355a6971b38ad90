"""GPU attention backends against the torch backend on the same seeded random weights.

Logits must agree within bf16 tolerance (relative error well under 1e-2) for prefill, extend over a cached
prefix and decode, at batch sizes 1 to 256 with mixed lengths, with CUDA graphs on and off; greedy decoding
in fp32 on the default model's shapes must agree token for token with the CPU.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.gpu.conftest import write_config
from tests.gpu.harness import SMALL_GQA, SMOLLM_135M, make_runner, rel_err

BACKENDS = [b for b in ("flashinfer", "triton") if importlib.util.find_spec(b) is not None]
if len(BACKENDS) == 2:
    BACKENDS.append("flashinfer_triton")
TOL = 1e-2


def scenario(harness, batch_size: int, seed: int = 0) -> list[torch.Tensor]:
    """Prefill mixed lengths, extend half the requests over another's cached prefix, then 3 decode steps."""
    rng = random.Random(seed)
    vocab = harness.runner.config.vocab_size
    rows = list(range(batch_size))
    lens = [rng.randint(1, 300) for _ in rows]
    outs = [harness.extend(rows, [[rng.randrange(vocab) for _ in range(n)] for n in lens])]
    if batch_size > 1:
        # Rows batch_size.. reuse a prefix of the first requests and extend it with new tokens.
        sharers = list(range(batch_size, batch_size + min(batch_size, 32)))
        for i, r in enumerate(sharers):
            harness.share_prefix(i, r, max(1, lens[i] // 2))
        outs.append(
            harness.extend(sharers, [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in sharers])
        )
        rows = rows + sharers
    for _ in range(3):
        outs.append(harness.decode(rows, [rng.randrange(vocab) for _ in rows]))
    return outs


@pytest.fixture(scope="module")
def gqa_config(config_dir):
    return write_config(config_dir, "small-gqa", SMALL_GQA)


@pytest.fixture(scope="module")
def smollm_config(config_dir):
    return write_config(config_dir, "smollm-135m", SMOLLM_135M)


BATCH_SIZES = (1, 3, 64, 256)


@pytest.fixture(scope="module")
def reference(gqa_config):
    _, harness = make_runner(gqa_config, "torch", max_reqs=320)
    out = {}
    for bs in BATCH_SIZES:
        harness.reset()
        out[bs] = scenario(harness, bs)
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cudagraph"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_torch(backend, graphs, gqa_config, reference):
    runner, harness = make_runner(gqa_config, backend, graphs=graphs, max_reqs=320)
    assert runner.info.attention_backend == backend
    assert (runner.graph_runner is not None) == graphs
    for bs in BATCH_SIZES:
        harness.reset()
        got = scenario(harness, bs)
        ref = reference[bs]
        errs = [rel_err(g, r) for g, r in zip(got, ref)]
        print(f"{backend} graphs={graphs} bs={bs}: rel err per phase {['%.2e' % e for e in errs]}")
        assert all(e < TOL for e in errs), errs


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_graphs_match_eager(backend, gqa_config):
    """Prefill steps of up to 256 tokens through the piecewise graphs (model/prefill_graphs.py): new prompts and
    extends over cached prefixes, mixed in one step, against the same steps run eagerly, then decode over the KV
    cache the graphs wrote."""
    _, eager = make_runner(gqa_config, backend, max_reqs=64)
    runner, graphed = make_runner(gqa_config, backend, max_reqs=64, prefill_graph_tokens=256)
    assert runner.prefill_graphs is not None and len(runner.prefill_graphs.graphs) == len(runner.prefill_graphs.sizes)
    ran = []
    original = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda batch: ran.append(batch.input_ids.shape[0]) or original(batch)
    rng, vocab, errs = random.Random(3), runner.config.vocab_size, []
    for step in range(24):
        rows = sorted(rng.sample(range(64), rng.randint(1, 8)))
        new_ids = [[rng.randrange(vocab) for _ in range(rng.choice((1, 3, 17, 40, 90)))] for _ in rows]
        all_logits = step % 5 == 4
        want = eager.extend(rows, new_ids, all_logits=all_logits)
        errs.append(rel_err(graphed.extend(rows, new_ids, all_logits=all_logits), want))
    rows = sorted(eager.lens)
    tokens = [rng.randrange(vocab) for _ in rows]
    errs.append(rel_err(graphed.decode(rows, tokens), eager.decode(rows, tokens)))
    print(f"{backend}: prefill graphs ran {len(ran)} of 24 steps; max rel err {max(errs):.2e}")
    assert len(ran) == sum(1 for n in ran if n <= 256) > 12
    assert max(errs) < TOL, errs


def test_auto_picks_gpu_backend():
    from gramserve.config import ServerArgs
    from gramserve.server.settings import resolve_settings

    assert resolve_settings(ServerArgs(device="cuda")).attention_backend == (
        "flashinfer_triton" if len(BACKENDS) == 3 else BACKENDS[0] if BACKENDS else "torch"
    )
    assert resolve_settings(ServerArgs(device="cuda", dtype="float32")).attention_backend == (
        "triton" if "triton" in BACKENDS else "torch"
    )


def greedy(harness, prompts: list[list[int]], steps: int) -> list[list[int]]:
    rows = list(range(len(prompts)))
    logits = harness.extend(rows, prompts)
    out = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(steps - 1):
        logits = harness.decode(rows, [o[-1] for o in out])
        for o, t in zip(out, logits.argmax(-1).tolist()):
            o.append(t)
    return out


@pytest.mark.parametrize("backend", ["torch"] + [b for b in BACKENDS if b == "triton"])
def test_greedy_fp32_token_for_token(backend, smollm_config):
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (5, 17, 64, 130)]
    cpu_runner, cpu = make_runner(smollm_config, "torch", dtype="float32", device="cpu", max_reqs=8, kv_gb=0.1)
    expect = greedy(cpu, prompts, 24)
    gpu_runner, gpu = make_runner(
        smollm_config, backend, dtype="float32", graphs=backend != "torch", max_reqs=8, graph_bs=8, kv_gb=0.5
    )
    gpu_runner.model.load_state_dict(cpu_runner.model.state_dict())  # the CPU's random weights (copied in place)
    got = greedy(gpu, prompts, 24)
    print(f"{backend}: {sum(a == b for x, y in zip(got, expect) for a, b in zip(x, y))}/{4 * 24} tokens agree")
    assert got == expect
