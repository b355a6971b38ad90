"""bf16 against FP8 projections on one GPU, on a model's layer shapes: `F.linear` with bf16 weights against
`Fp8Linear` (the per-token activation quantizer and the scaled GEMM), per matrix and per whole layer, at several
row counts (decode batches and prefill chunks). CUDA graphs replay each call, so launch gaps do not count.

    python benchmarks/bench_fp8_gemm.py --model .gpu/models/llama-3.1-8b.json --rows 1,64,256,1024,4096,8192
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from gramserve.model.fp8_linear import Fp8Linear


def layer_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of the fused projections of one decoder layer."""
    h, head = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    inter = cfg["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def time_graph(fn, iters: int = 50) -> float:
    """Median microseconds of one call, replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model config.json")
    p.add_argument("--rows", default="1,64,256,1024,4096,8192")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    cfg = json.load(open(args.model))
    torch.manual_seed(0)
    results = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| rows | matrix | bf16 us | fp8 us | speed-up | fp8 TFLOP/s |")
    print("|---:|---|---:|---:|---:|---:|")
    weights = {}
    for name, (n, k) in layer_shapes(cfg).items():
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).contiguous()
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        lin.weight.data = w
        weights[name] = (w, Fp8Linear.of(lin))
    for rows in (int(r) for r in args.rows.split(",")):
        total = [0.0, 0.0]
        for name, (w, fp8) in weights.items():
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            bf16_us = time_graph(lambda x=x, w=w: F.linear(x, w))
            fp8_us = time_graph(lambda x=x, fp8=fp8: fp8(x))
            total[0] += bf16_us
            total[1] += fp8_us
            tflops = 2 * rows * w.numel() / fp8_us / 1e6
            results.append(dict(rows=rows, matrix=name, bf16_us=bf16_us, fp8_us=fp8_us))
            print(f"| {rows} | {name} | {bf16_us:.1f} | {fp8_us:.1f} | {bf16_us / fp8_us:.2f} | {tflops:.0f} |")
        print(f"| {rows} | **layer** | {total[0]:.1f} | {total[1]:.1f} | **{total[0] / total[1]:.2f}** | |")
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
