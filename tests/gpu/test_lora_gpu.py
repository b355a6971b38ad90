"""LoRA on the GPU: the Triton segmented matmul against the torch path, and a model forward with adapters mixed in
one batch (CUDA graphs against eager, adapters against the base)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from gramserve.model.lora.adapter import load_adapter
from gramserve.model.lora.batch import make_lora_batch
from gramserve.model.lora.compute import add_lora_torch
from gramserve.model.lora.pool import ProjectionPool, SubModule
from gramserve.model.model_config import ModelConfig
from tests.gpu.conftest import write_config
from tests.gpu.harness import SMALL_GQA, make_runner, rel_err

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from lora_adapters import write_random_adapter  # noqa: E402


@pytest.mark.parametrize("rank", [16, 64, 128])
@pytest.mark.parametrize("shape", [(4096, (4096, 1024, 1024)), (14336, (4096,)), (4096, (14336, 14336))])
def test_triton_kernel_matches_torch(rank, shape):
    from gramserve.model.lora import triton_ops

    fan_in, outs = shape
    g = torch.Generator(device="cuda").manual_seed(rank)
    subs, start = [], 0
    for i, n in enumerate(outs):
        subs.append(SubModule(f"m{i}", start, start + n, start, i))
        start += n
    slots = 5
    a = (torch.randn(slots, len(outs) * rank, fan_in, device="cuda", generator=g) / fan_in**0.5).bfloat16()
    b = (torch.randn(slots, start, rank, device="cuda", generator=g) * 0.05).bfloat16()
    proj = ProjectionPool(a, b, tuple(subs), rank)
    for row_slots, tokens in (([0, 1, 1, -1, 4, 2], None), ([3, -1, 0], [300, 7, 1000]), ([2] * 64, None)):
        n = sum(tokens) if tokens else len(row_slots)
        x = torch.randn(n, fan_in, device="cuda", generator=g).bfloat16()
        y = torch.randn(n, start, device="cuda", generator=g).bfloat16()
        batch = make_lora_batch(row_slots, torch.device("cuda"), tokens)
        want, got = y.float(), y.clone()
        add_lora_torch(want, x.float(), ProjectionPool(a.float(), b.float(), proj.subs, rank), batch)
        triton_ops.add_lora(got, x, proj, batch)
        assert rel_err(got - y, want - y.float()) < 2e-2


def test_mixed_adapter_batch_graphs_and_eager(config_dir, tmp_path):
    cfg_path = write_config(config_dir, "small_lora", SMALL_GQA)
    model_cfg = ModelConfig.from_dict(SMALL_GQA)
    adapters = [
        load_adapter(
            write_random_adapter(SMALL_GQA, str(tmp_path / f"l{i}"), 16, seed=i), model_cfg, 16, dtype=torch.bfloat16
        )
        for i in range(2)
    ]
    prompts = [[5, 6, 7, 8, 9] * 9, [11, 12, 13] * 20, [21, 22, 23, 24] * 11, [5, 6, 7, 8, 9] * 9]
    slots = [0, 1, -1, -1]  # rows 0 and 3: the same prompt with and without adapter 0
    logits = {}
    for graphs in (False, True):
        runner, h = make_runner(cfg_path, "triton", graphs=graphs, graph_bs=8, max_reqs=8, lora_slots=2)
        for slot, adapter in enumerate(adapters):
            runner.lora_pool.load(slot, adapter)
        steps = [h.extend([0, 1, 2, 3], prompts, lora=slots)]
        tokens = steps[0].argmax(-1).tolist()
        for _ in range(6):
            steps.append(h.decode([0, 1, 2, 3], tokens, lora=slots))
            tokens = steps[-1].argmax(-1).tolist()
        logits[graphs] = torch.stack(steps)
        # rows without an adapter: as a runner without LoRA computes them
        if not graphs:
            plain, hp = make_runner(cfg_path, "triton", graphs=False, max_reqs=8)
            base = hp.extend([0, 1, 2, 3], prompts)
            assert rel_err(steps[0][2:], base[2:]) < 1e-2
            assert rel_err(steps[0][0], base[0]) > 1e-2  # adapter 0 changes its row
        del runner
    assert rel_err(logits[True], logits[False]) < 2e-2
