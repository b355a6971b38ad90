"""Where the GPU's time goes, from torch.profiler's kernel trace (GPU host only).

    python benchmarks/bench_gpu_profile.py --assets .gpu [--sections decode,grammar] [--out profile.json]

* decode: the 8B throughput workload of bench_gpu.py (1,000 requests) run once to fill the prefix cache, then
  again under the profiler: every prompt is then a cache hit, so the second run is the decode steps alone.
  Reports the unprofiled tok/s, GPU busy time against the wall, idle gaps, and kernel time by kind.
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

KINDS = (("nvjet", "gemm"), ("gemm", "gemm"), ("cutlass", "gemm"), ("cublas", "gemm"), ("prefill", "attn_prefill"),
         ("decode", "attn_decode"), ("rmsnorm", "norm"), ("rope", "rope"), ("silu", "silu"), ("argmax", "sampling"),
         ("mask", "bitmask"), ("memcpy", "copy"), ("copy", "copy"), ("index", "index"), ("gather", "index"),
         ("scatter", "index"))


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
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, gaps, start, end = 0.0, [], None, None
    for s, e in spans:
        if end is None or s > end:
            if end is not None:
                busy += end - start
                gaps.append(s - end)
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        busy += end - start
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return {"wall_s": wall_s, "kernels": len(events), "busy_ms": busy / 1e3, "span_ms": span / 1e3,
            "idle_ms": (span - busy) / 1e3, "gaps_over_50us": sum(1 for g in gaps if g > 50),
            "gaps_over_50us_ms": sum(g for g in gaps if g > 50) / 1e3,
            "by_kind_ms": {k: round(v / 1e3, 1) for k, v in by_kind.most_common()},
            "top_kernels_ms": [(k, round(v / 1e3, 1)) for k, v in by_name.most_common(15)]}


def profile_decode(assets: str) -> dict:
    eng = B.Engine(os.path.join(assets, "llama-3.1-8b.json"), assets, grammar=False)
    reqs = B.workload(1000, 0, 49152)
    for prompt, n in reqs:
        eng.add(prompt, n)
    first = eng.run()
    for prompt, n in reqs:  # the same prompts again: all prefix-cache hits, so decode steps only
        eng.add(prompt, n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        again = eng.run()
    out = {"tok_s_unprofiled": first["output_tokens"] / first["wall_s"],
           "decode_only": summarize(prof, again["wall_s"])}
    eng.close()
    return out


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
        out["constrained" if constrained else "unconstrained"] = {"step_ms": res["step_ms"],
                                                                 **summarize(prof, 0.0)}
    eng.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default=".gpu")
    p.add_argument("--sections", default="decode,grammar")
    p.add_argument("--out", default="bench_gpu_profile.json")
    args = p.parse_args()
    results = {}
    sections = args.sections.split(",")
    if "decode" in sections:
        results["decode"] = profile_decode(args.assets)
    if "grammar" in sections:
        results["grammar"] = profile_grammar(args.assets)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
