"""The parts of tensor parallelism, each on its own: how the model is split (Partition), that seeded dummy weights
split into shards that put back together give the single-device weights, the shared-memory collectives between
real processes, and the clear refusals of settings that cannot run."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import free_port

from gramserve.model.llama import LlamaForCausalLM
from gramserve.model.model_config import ModelConfig
from gramserve.model.parallel import Partition, split_range
from gramserve.model.shm_collectives import SLOT_BYTES, ShmCollectives

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 101,  # not a multiple of the rank count: the last shard is padded
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def test_uneven_splits_follow_kv_heads():
    cfg = ModelConfig.from_dict(TINY)
    parts = [Partition.of(cfg, r, 2) for r in range(2)]
    assert [p.kv_heads for p in parts] == [(0, 2), (2, 3)]
    assert [p.q_heads for p in parts] == [(0, 4), (4, 6)]  # the query heads of those KV heads
    assert [p.intermediate for p in parts] == [(0, 48), (48, 96)]
    assert [p.vocab for p in parts] == [(0, 51), (51, 101)] and parts[0].vocab_per_rank == 51
    assert [split_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(Exception, match="more than the model's 3 KV heads"):
        Partition.of(cfg, 0, 4)


def _model(cfg: ModelConfig, rank: int, size: int) -> LlamaForCausalLM:
    tp = SimpleNamespace(rank=rank, size=size)  # the split only: no collective runs here
    model = LlamaForCausalLM(cfg, 128, tp)
    model.init_dummy_weights(seed=7)
    return model


def test_dummy_shards_put_together_are_the_single_device_weights():
    cfg = ModelConfig.from_dict(TINY)
    whole = dict(_model(cfg, 0, 1).named_parameters())
    shards = [dict(_model(cfg, r, 2).named_parameters()) for r in range(2)]
    q, kv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    for layer in range(cfg.num_layers):
        pre = f"layers.{layer}."
        qkv = [s[pre + "self_attn.qkv_proj.weight"] for s in shards]
        q_rows = torch.cat([t[: Partition.of(cfg, r, 2).num_heads * hd] for r, t in enumerate(qkv)])
        assert torch.equal(q_rows, whole[pre + "self_attn.qkv_proj.weight"][:q])
        v_rows = torch.cat([t[-Partition.of(cfg, r, 2).num_kv_heads * hd :] for r, t in enumerate(qkv)])
        assert torch.equal(v_rows, whole[pre + "self_attn.qkv_proj.weight"][q + kv :])
        o = torch.cat([s[pre + "self_attn.o_proj.weight"] for s in shards], dim=1)
        assert torch.equal(o, whole[pre + "self_attn.o_proj.weight"])
        down = torch.cat([s[pre + "mlp.down_proj.weight"] for s in shards], dim=1)
        assert torch.equal(down, whole[pre + "mlp.down_proj.weight"])
        gate = torch.cat([s[pre + "mlp.gate_up_proj.weight"][:48] for s in shards])
        assert torch.equal(gate, whole[pre + "mlp.gate_up_proj.weight"][:96])
    rows = torch.cat([s["lm_head.weight"] for s in shards])
    assert torch.equal(rows[:101], whole["lm_head.weight"]) and not rows[101:].any()  # the padding row is zero


def _collectives(rank: int, name, results) -> None:
    shm = ShmCollectives(rank, 2, name.get() if rank else None)
    if rank == 0:
        name.put(shm.name)
    big = SLOT_BYTES // 4 * 2 + 5  # three chunks
    x = torch.arange(big, dtype=torch.float32) * (rank + 1)
    shm.all_reduce(x)
    if rank == 0:  # rank 1 took part: it has attached
        shm.unlink()
    ok = torch.equal(x, torch.arange(big, dtype=torch.float32) * 3)
    gathered = shm.all_gather(torch.full((3, 4), float(rank)))
    ok &= torch.equal(gathered[:, 0, 0], torch.tensor([0.0, 1.0]))
    b = torch.arange(7, dtype=torch.float32) if rank == 0 else torch.zeros(7)
    ok &= torch.equal(shm.broadcast(b), torch.arange(7, dtype=torch.float32))
    for i in range(200):  # many small operations in a row: the two parities alternate
        y = torch.tensor([float(rank + i)])
        ok &= shm.all_reduce(y).item() == 2 * i + 1
    results.put((rank, bool(ok)))


def test_shared_memory_collectives_between_two_processes():
    ctx = mp.get_context("spawn")
    name, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_collectives, args=(r, name, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(30)
    assert got == {0: True, 1: True}


def test_settings_that_cannot_run_are_refused():
    serve = [sys.executable, "-m", "gramserve", "serve", "--port", str(free_port())]
    run = subprocess.run(serve + ["--tp-size", "4"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "more than the model's 3 KV heads" in run.stderr
    run = subprocess.run(serve + ["--tp-size", "2", "--nnodes", "2"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "needs dist_init_addr" in run.stderr
    run = subprocess.run(serve + ["--tp-size", "2", "--enable-lora"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "LoRA adapters with tp_size > 1" in run.stderr
