"""Where the GPU's time goes, from torch.profiler's kernel trace (GPU host only).

    python benchmarks/bench_gpu_profile.py --assets .gpu [--sections decode,grammar] [--out profile.json]

* decode: the 8B throughput workload of bench_gpu.py (1,000 requests) run once to fill the prefix cache, then
  again under the profiler: every prompt is then a cache hit, so the second run is the decode steps alone.
  Reports the unprofiled tok/s, GPU busy time against the wall, idle gaps, and kernel time by kind.
* cold: the same workload in a fresh prefix cache under the profiler (prefill chunks and decode steps), with
  the step timeline by kind; set against `decode`, the difference is what prefill costs.
* gemm: the ceiling for the GEMMs: each of the 8B's linear layers alone (cuBLAS through F.linear) at the row
  counts the workload runs (8,192-token prefill chunks, decode batches), in TFLOP/s and weight-streaming GB/s.
* b1: the batch-1 decode graph of each model replayed under the profiler after a 128-token prompt: the
  kernels of one token by kind and by name, and the GEMMs' time against streaming their weights at the copy
  bandwidth measured in the same run (what keeps batch-1 decode off the roofline).
* grammar: the 1B at batch 256, one unconstrained and one constrained pass of bench_gpu.py's grammar section
  under the profiler: how much longer the GPU sits idle per constrained step, and the mask kernels' own time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as B  # noqa: E402

KINDS = (
    ("nvjet", "gemm"),
    ("gemm", "gemm"),
    ("cutlass", "gemm"),
    ("cublas", "gemm"),
    ("prefill", "attn_prefill"),
    ("decode", "attn_decode"),
    ("rmsnorm", "norm"),
    ("rope", "rope"),
    ("silu", "silu"),
    ("argmax", "sampling"),
    ("mask", "bitmask"),
    ("memcpy", "copy"),
    ("copy", "copy"),
    ("index", "index"),
    ("gather", "index"),
    ("scatter", "index"),
)


def kind(kernel: str) -> str:
    name = kernel.lower()
    return next((k for key, k in KINDS if key in name), "other")


def summarize(prof, wall_s: float) -> dict:
    """Kernel time by kind and by name, GPU busy time (union of kernel intervals), idle gaps between kernels."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind, by_name, spans = collections.Counter(), collections.Counter(), []
    for e in events:
        us = e.time_range.end - e.time_range.start
        by_kind[kind(e.name)] += us
        by_name[e.name[:90]] += us
        spans.append((e.time_range.start, e.time_range.end, e.name))
    spans.sort()
    busy, gaps, start, end, last = 0.0, [], None, None, ""
    around = collections.Counter()  # (kernel before, kernel after) of each gap over 50 us: where the GPU waits
    around_ms = collections.Counter()
    for s, e, name in spans:
        if end is None or s > end:
            if end is not None:
                busy += end - start
                gaps.append(s - end)
                if s - end > 50:
                    key = f"{last[:40]} -> {name[:40]}"
                    around[key] += 1
                    around_ms[key] += (s - end) / 1e3
            start, end = s, e
        else:
            end = max(end, e)
        if e >= end:
            last = name
    if end is not None:
        busy += end - start
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return {
        "wall_s": wall_s,
        "kernels": len(events),
        "busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "gaps_over_50us": sum(1 for g in gaps if g > 50),
        "gaps_over_50us_ms": sum(g for g in gaps if g > 50) / 1e3,
        "gaps_around": [(k, n, round(around_ms[k], 1)) for k, n in around.most_common(12)],
        "by_kind_ms": {k: round(v / 1e3, 3) for k, v in by_kind.most_common()},
        "top_kernels_ms": [(k, round(v / 1e3, 3)) for k, v in by_name.most_common(25)],
    }


def profile_throughput(assets: str, cold: bool) -> dict:
    """The 8B workload once unprofiled, then again under the profiler: with the prefix cache kept (`cold` False)
    every prompt is a hit, so the second run is the decode steps alone; with it emptied, prefill and decode."""
    eng = B.Engine(os.path.join(assets, "llama-3.1-8b.json"), assets, grammar=False)
    reqs = B.workload(1000, 0, 49152)
    for prompt, n in reqs:
        eng.add(prompt, n)
    first = eng.run()
    if cold:
        eng.sched.cache.reset()
    for prompt, n in reqs:
        eng.add(prompt, n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        again = eng.run()
    eng.close()
    steps = collections.defaultdict(lambda: [0, 0.0])  # step kind -> count, host seconds
    for kind_, _, _, dt in again["steps"]:
        steps[kind_][0] += 1
        steps[kind_][1] += dt
    return {
        "tok_s_unprofiled": first["output_tokens"] / first["wall_s"],
        "tok_s_profiled": again["output_tokens"] / again["wall_s"],
        "steps": {k: {"count": c, "host_s": round(t, 3)} for k, (c, t) in steps.items()},
        "cold" if cold else "decode_only": summarize(prof, again["wall_s"]),
    }


def profile_gemm(assets: str) -> dict:
    """TFLOP/s of each linear layer of the 8B alone, at prefill-chunk and decode row counts."""
    from triton.testing import do_bench

    cfg = json.load(open(os.path.join(assets, "llama-3.1-8b.json")))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    shapes = {
        "qkv_proj": (h, (heads + 2 * kv) * hd),
        "o_proj": (heads * hd, h),
        "gate_up_proj": (h, 2 * inter),
        "down_proj": (inter, h),
        "lm_head": (h, cfg["vocab_size"]),
    }
    out = {}
    for rows in (8192, 4096, 1024, 512, 256, 64):
        per = {}
        for name, (k, n) in shapes.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ms = do_bench(lambda: torch.nn.functional.linear(x, w), warmup=20, rep=100)
            per[name] = {
                "us": round(ms * 1e3, 1),
                "tflops": round(2 * rows * k * n / ms / 1e9, 1),
                "weight_gbs": round(n * k * 2 / ms / 1e6, 1),
            }
        layer_ms = sum(v["us"] for k_, v in per.items() if k_ != "lm_head") / 1e3
        flops = 2 * rows * sum(k * n for k_, (k, n) in shapes.items() if k_ != "lm_head")
        per["layer"] = {"us": round(layer_ms * 1e3, 1), "tflops": round(flops / layer_ms / 1e9, 1)}
        out[rows] = per
    return out


def profile_b1(assets: str, model: str, tokens: int = 50) -> dict:
    """Kernel time per token of the batch-1 decode graph, by kind and by name."""
    bw = B.copy_bandwidth()  # before the engine takes the memory for its KV pool
    eng = B.Engine(os.path.join(assets, f"{model}.json"), assets, grammar=False)
    rng = random.Random(0)
    eng.add([rng.randrange(100, eng.vocab) for _ in range(128)], 64)
    eng.run()  # leaves the graph's inputs at a real request of ~190 cached tokens
    graph = eng.sched.runner.graph_runner.graphs[1]
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(tokens):
            graph.replay()
        torch.cuda.synchronize()
    summary = summarize(prof, 0.0)
    per_token = {k: round(v * 1e3 / tokens, 1) for k, v in summary["by_kind_ms"].items()}  # us
    wbytes = B.weight_bytes_per_token(eng.sched.runner)
    eng.close()
    return {
        "copy_tb_s": bw / 1e12,
        "kernels_per_token": summary["kernels"] / tokens,
        "busy_us_per_token": round(summary["busy_ms"] * 1e3 / tokens, 1),
        "span_us_per_token": round(summary["span_ms"] * 1e3 / tokens, 1),
        "weights_at_copy_bw_us": round(wbytes / bw * 1e6, 1),
        "us_per_token_by_kind": per_token,
        "top_kernels_us_per_token": [(k, round(v * 1e3 / tokens, 1)) for k, v in summary["top_kernels_ms"]],
    }


def profile_grammar(assets: str, bs: int = 256) -> dict:
    eng = B.Engine(os.path.join(assets, "llama-3.2-1b.json"), assets, grammar=True)
    rng = random.Random(3)
    eng.add([rng.randrange(100, eng.vocab) for _ in range(32)], 8, grammar=True)  # compile + warm-up
    eng.run()
    for constrained in (False, True):
        B._grammar_pass(eng, "1b", bs, constrained, 96, rng)  # warm-up passes
    out = {}
    for constrained in (False, True):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res = B._grammar_pass(eng, "1b", bs, constrained, 96, rng)
        out["constrained" if constrained else "unconstrained"] = {"step_ms": res["step_ms"], **summarize(prof, 0.0)}
    eng.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default=".gpu")
    p.add_argument("--sections", default="decode,cold,gemm,b1,grammar")
    p.add_argument("--out", default="bench_gpu_profile.json")
    args = p.parse_args()
    results = {}
    sections = args.sections.split(",")
    if "decode" in sections:
        results["decode"] = profile_throughput(args.assets, cold=False)
    if "cold" in sections:
        results["cold"] = profile_throughput(args.assets, cold=True)
    if "gemm" in sections:
        results["gemm"] = profile_gemm(args.assets)
    if "b1" in sections:
        results["b1"] = {m: profile_b1(args.assets, m) for m in ("llama-3.2-1b", "llama-3.1-8b")}
    if "grammar" in sections:
        results["grammar"] = profile_grammar(args.assets)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
