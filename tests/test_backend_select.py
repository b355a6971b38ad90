"""CPU-side checks of the GPU path's plumbing: backend choice, device defaults, graph batch sizes, the greedy
fast path."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from gramserve.config import DEVICE_DEFAULTS, ServerArgs
from gramserve.model.attention import create_backend, resolve_backend_name
from gramserve.model.cuda_graph_runner import capture_sizes
from gramserve.model.kv_cache import KVCache
from gramserve.sampling.params import SamplingParams
from gramserve.sampling.sampler import Sampler, SamplingRow
from gramserve.server.settings import resolve_settings


def test_auto_is_torch_on_cpu():
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float32) == "torch"
    assert resolve_backend_name("triton", torch.device("cpu"), torch.float32) == "triton"


@pytest.mark.parametrize("name", ["flashinfer", "triton"])
def test_gpu_backends_refuse_cpu(name):
    kv = KVCache(1, 8, 2, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        create_backend(name, kv, 4)


def test_device_defaults_fill_what_the_command_line_leaves_out(monkeypatch):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)

    def settings(*argv: str):
        return resolve_settings(ServerArgs.from_cli_args(parser.parse_args(list(argv))))

    for device in ("cpu", "cuda"):
        got = settings("--device", device)
        want = DEVICE_DEFAULTS[device]
        assert (got.max_running_requests, got.chunked_prefill_size, got.max_consecutive_prefills) == (
            want.max_running_requests,
            want.chunked_prefill_size,
            want.max_consecutive_prefills,
        )
        # No CUDA graphs off CUDA; on CUDA the device's default size.
        assert got.cuda_graph_max_bs == (want.cuda_graph_max_bs if device == "cuda" else 0)
    given = settings(
        "--device", "cuda", "--max-running-requests", "64", "--chunked-prefill-size", "0", "--cuda-graph-max-bs", "8"
    )
    assert (given.max_running_requests, given.chunked_prefill_size, given.cuda_graph_max_bs) == (64, 0, 8)
    assert settings("--device", "cuda", "--disable-cuda-graph").cuda_graph_max_bs == 0
    # Prefill graphs: CUDA only, off with --disable-cuda-graph and (for now) under tensor parallelism.
    assert settings("--device", "cuda").prefill_graph_max_tokens == DEVICE_DEFAULTS["cuda"].prefill_graph_max_tokens > 0
    assert settings("--device", "cpu", "--prefill-graph-max-tokens", "64").prefill_graph_max_tokens == 0
    assert settings("--device", "cuda", "--prefill-graph-max-tokens", "64").prefill_graph_max_tokens == 64
    assert settings("--device", "cuda", "--disable-cuda-graph").prefill_graph_max_tokens == 0
    assert settings("--device", "cuda", "--tp-size", "2").prefill_graph_max_tokens == 0
    assert settings("--device", "cuda", "--max-consecutive-prefills", "3").max_consecutive_prefills == 3
    assert settings("--device", "cuda", "--max-prefill-wait-steps", "5").max_prefill_wait_steps == 5
    assert settings("--device", "cpu").max_prefill_wait_steps == DEVICE_DEFAULTS["cpu"].max_prefill_wait_steps == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-prefill-wait-steps", "-1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-consecutive-prefills", "-1"])
    assert DEVICE_DEFAULTS["cuda"].chunked_prefill_size > DEVICE_DEFAULTS["cpu"].chunked_prefill_size
    # The overlap schedule: on for CUDA, off on CPU, unless given.
    assert settings("--device", "cuda").overlap_schedule and not settings("--device", "cpu").overlap_schedule
    assert settings("--device", "cpu", "--overlap-schedule", "on").overlap_schedule
    assert not settings("--device", "cuda", "--disable-overlap-schedule").overlap_schedule
    # Grammar workers: one on CPU; on CUDA one per two cores, at most the cap; as given when given.
    import gramserve.server.settings as settings_module

    for cores, want_shards in ((2, 1), (16, 8), (64, 8)):
        monkeypatch.setattr(settings_module, "available_cores", lambda cores=cores: cores)
        assert resolve_settings(ServerArgs(device="cuda")).grammar_shards == want_shards
        assert resolve_settings(ServerArgs(device="cpu")).grammar_shards == 1
    monkeypatch.undo()
    assert settings("--device", "cuda", "--grammar-shards", "3").grammar_shards == 3
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):  # argparse's usage error, exit status 2
            parser.parse_args(["--grammar-shards", bad])
    with pytest.raises(ValueError, match="grammar_shards"):
        ServerArgs(grammar_shards=0)
    with pytest.raises(ValueError, match="port must be in"):  # uvicorn started "on" port 99999
        ServerArgs(port=99999)
    # auto on this machine: whatever torch sees.
    auto = resolve_settings(ServerArgs())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto.device == device
    assert auto.max_running_requests == DEVICE_DEFAULTS[device].max_running_requests
    assert (auto.dtype, auto.attention_backend) == (
        ("bfloat16", auto.attention_backend) if device == "cuda" else ("float32", "torch")
    )


def test_server_args_are_frozen_as_parsed():
    args = ServerArgs()
    assert args.max_running_requests is None and args.device == "auto"  # resolved into Settings, not here
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_running_requests = 4


def test_capture_sizes():
    assert capture_sizes(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and capture_sizes(256)[-1] == 256
    assert capture_sizes(100)[-1] == 100 and capture_sizes(512)[-1] == 512
    assert capture_sizes(1) == [1]


def test_greedy_fast_path_matches_full_path():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g)
    logits[:, 32:] += 100.0  # padding columns (tokenizer has 32 tokens) must never win
    sampler = Sampler(40, 32, torch.device("cpu"))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None) for _ in range(5)]
    fast = sampler.sample(logits, rows)
    full = sampler.sample(logits, rows, num_top_logprobs=0)  # logprobs take the full path
    assert fast.token_ids == full.token_ids == logits[:, :32].argmax(-1).tolist()
    assert fast.logprobs is None


def test_sampling_backend_choice(capsys):
    from gramserve.cli import main
    from gramserve.sampling.flashinfer_sampling import resolve_sampling_backend

    assert resolve_sampling_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_settings(ServerArgs(device="cpu")).sampling_backend == "torch"
    assert Sampler(40, 32, torch.device("cpu")).kernels is None
    with pytest.raises(ValueError, match="CUDA"):
        resolve_sampling_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown sampling backend"):
        resolve_sampling_backend("sorted", torch.device("cpu"))
    # The command line refuses flashinfer sampling on the CPU with a usage error, before anything starts.
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", "--sampling-backend", "flashinfer"])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
