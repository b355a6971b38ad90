"""Random sampling on a GPU: the torch sampler (sorts the vocabulary for top-k / top-p) against FlashInfer's
sort-free kernels (`--sampling-backend`), side by side in one run (GPU host only).

    python benchmarks/bench_sampling.py --assets .gpu [--sections kernel,throughput] [--out bench_sampling.json]

* kernel: one sampling step (launch + the ids on the host) over Llama 3's 128,256 logits columns at batch 1 to
  1,024, for plain temperature sampling, top-p, and top-k + top-p; median of CUDA-event timings.
* throughput: bench_gpu.py's 8B workload (1,000 requests, all at once) at temperature 0.8 / top_p 0.95 through an
  engine of each backend, and greedy for reference: output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as B  # noqa: E402

from gramserve.sampling.params import SamplingParams  # noqa: E402
from gramserve.sampling.sampler import Sampler, SamplingRow  # noqa: E402

VOCAB = 128256
CASES = {
    "temperature 0.8": {"temperature": 0.8},
    "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top_k 50 + top_p 0.95": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
}


def step_ms(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], reps: int = 30) -> float:
    times = []
    for i in range(reps + 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sampler.sample(logits, rows)
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_kernel() -> dict:
    dev = torch.device("cuda")
    samplers = {name: Sampler(VOCAB, VOCAB, dev, backend=name) for name in ("torch", "flashinfer")}
    out = {}
    for bs in (1, 32, 256, 1024):
        logits = torch.randn(bs, VOCAB, device=dev) * 4
        for case, kw in CASES.items():
            rows = [SamplingRow(SamplingParams(**kw), [], [], None) for _ in range(bs)]
            ms = {name: step_ms(s, logits, rows) for name, s in samplers.items()}
            out[f"bs {bs}, {case}"] = {
                **{k: round(v, 3) for k, v in ms.items()},
                "speedup": round(ms["torch"] / ms["flashinfer"], 1),
            }
            print(
                f"bs {bs:5d} {case:24s} torch {ms['torch']:8.3f} ms  flashinfer {ms['flashinfer']:7.3f} ms", flush=True
            )
    return out


def bench_throughput(assets: str) -> dict:
    model = os.path.join(assets, "llama-3.1-8b.json")
    reqs = B.workload(1000, 0, 49152)
    out = {}
    for backend in ("flashinfer", "torch"):
        eng = B.Engine(model, assets, grammar=False, sampling_backend=backend)
        runs = [("temperature 0.8, top_p 0.95", {"temperature": 0.8, "top_p": 0.95})]
        if backend == "flashinfer":
            runs.append(("greedy", {}))
        for label, kw in runs:
            eng.sched.cache.reset()
            for prompt, n in reqs:
                eng.add(prompt, n, **kw)
            res = eng.run()
            tok_s = res["output_tokens"] / res["wall_s"]
            out[f"{backend}, {label}"] = round(tok_s)
            print(f"{backend:10s} {label:28s} {tok_s:9.0f} tok/s", flush=True)
        eng.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default=".gpu")
    p.add_argument("--sections", default="kernel,throughput")
    p.add_argument("--out", default="bench_sampling.json")
    args = p.parse_args()
    sections = args.sections.split(",")
    results = {"gpu": torch.cuda.get_device_name()}
    for name, run in (("kernel", bench_kernel), ("throughput", lambda: bench_throughput(args.assets))):
        if name in sections:
            results[name] = run()
            with open(args.out, "w") as f:  # after each section, so a later failure keeps the earlier results
                json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
