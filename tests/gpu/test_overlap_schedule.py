"""The scheduler on a GPU: the overlap schedule gives the same greedy tokens as the plain loop (with and without
running requests decoding inside prefill steps), and a steady decode step launches its work without any hidden
device-to-host synchronization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from gramserve.config import ServerArgs
from gramserve.messages import TokenizedGenerateReq
from gramserve.model.loader import default_tokenizer_dir
from gramserve.sampling.params import SamplingParams
from gramserve.scheduler.scheduler import Scheduler
from gramserve.server.settings import in_process_config
from tests.gpu.conftest import write_config
from tests.gpu.harness import SMOLLM_135M


def _tokenizer_dir() -> str:
    # GPU hosts carry the tokenizer files in .gpu/tok or .gpu/ (the GGUF package is not installed there).
    gpu = Path(__file__).resolve().parents[2] / ".gpu"
    for local in (gpu / "tok", gpu):
        if (local / "tokenizer.json").exists():
            return str(local)
    return default_tokenizer_dir()


def _scheduler(config_dir, overlap: str, mixed: str = "off") -> Scheduler:
    path = write_config(config_dir, "smollm-overlap", SMOLLM_135M)
    tok = _tokenizer_dir()
    args = ServerArgs(
        model_path=path,
        load_format="dummy",
        tokenizer_path=tok,
        context_length=2048,
        kv_cache_memory_gb=1.0,
        max_running_requests=64,
        overlap_schedule=overlap,
        mixed_decode=mixed,
        dtype="float32",
        cuda_graph_max_bs=64,
    )
    return Scheduler(in_process_config(args, tokenizer_dir=tok), AutoTokenizer.from_pretrained(tok))


def _run(sched: Scheduler, n: int = 40) -> dict[str, list[int]]:
    """n requests of random prompts and lengths, arriving in four waves (later prompts prefill while earlier
    requests decode)."""
    rng = random.Random(0)
    outs: dict[str, list[int]] = {}
    for i in range(n):
        prompt = [rng.randrange(100, 49152) for _ in range(rng.randint(3, 200))]
        sched.add_request(
            TokenizedGenerateReq(
                f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(1, 48), temperature=0, ignore_eos=i % 2 == 0)
            )
        )
        if i % 10 == 9:
            for _ in range(3):
                out = sched.step()
                for rid, ids in zip(out.rids, out.new_token_ids) if out else ():
                    outs.setdefault(rid, []).extend(ids)
    while sched.has_work:
        out = sched.step()
        for rid, ids in zip(out.rids, out.new_token_ids) if out else ():
            outs.setdefault(rid, []).extend(ids)
    return outs


@pytest.mark.parametrize("mixed", ["off", "on"])
def test_overlap_matches_plain_and_never_syncs_while_launching(config_dir, mixed):
    plain = _run(_scheduler(config_dir, "off", mixed))
    sched = _scheduler(config_dir, "on", mixed)
    assert sched.overlap and sched.mixed_decode == (mixed == "on")
    assert _run(sched) == plain
    assert (sched.stats["mixed_decode_rows"] > 0) == (mixed == "on")
    assert sched.allocator.num_free + sched.cache.evictable_size == sched.allocator.size

    # Steady decode: launching step N+1's forward must not wait for step N (no implicit syncs).
    for i in range(8):
        sched.add_request(
            TokenizedGenerateReq(
                f"s{i}", [100 + i] * 20, SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
            )
        )
    for _ in range(4):
        sched.step()
    torch.cuda.set_sync_debug_mode("error")  # an implicit sync (a blocking copy, .item(), .tolist()) raises
    try:
        for _ in range(10):
            out = sched.step()
            assert out is not None and len(out.rids) == 8
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while sched.has_work:
        sched.step()
