"""The LoRA kernels' cost inside a decode step, at a model's real shapes, on one GPU (not through the server).

For each case (rank, batch size, adapters in the batch) it captures in one CUDA graph what a decode step does in its
projections, for every layer: x @ W^T for qkv / o / gate_up / down (random bf16 weights of the config's shapes),
plus the adapters' shrink and expand (model/lora/triton_ops.py). Replay times are compared with the same graph
without LoRA and with the bytes the step must read (base weights, plus each adapter in the batch once) at the
device's measured copy bandwidth. Variants of the kernels' launch parameters run side by side, and "side stream"
runs each shrink on a second stream beside the base matmul (forked and joined inside the graph).

python benchmarks/bench_lora_kernels.py --config ../shared/models/llama-3.1-8b.json --ranks 16 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from gramserve.config import LORA_TARGET_MODULES
from gramserve.model.lora import triton_ops
from gramserve.model.lora.batch import BLOCK_M, LoRABatch
from gramserve.model.lora.pool import LoRAPool
from gramserve.model.model_config import ModelConfig

VARIANTS = {
    "default": triton_ops.KernelConfig(),  # at most 8 K splits, expand groups of 4 tiles
    "no split limit, group 1": triton_ops.KernelConfig(max_splits=0, expand_group=1),
    "max 4 splits": triton_ops.KernelConfig(max_splits=4),
    "max 16 splits": triton_ops.KernelConfig(max_splits=16),
    "group 2": triton_ops.KernelConfig(expand_group=2),
    "group 8": triton_ops.KernelConfig(expand_group=8),
    "shrink k 128": triton_ops.KernelConfig(shrink_block_k=128),
    "shrink 4 stages": triton_ops.KernelConfig(shrink_stages=4),
    "expand block 64": triton_ops.KernelConfig(expand_block_n=64),
}


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second that a large device-to-device copy moves (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (time.perf_counter() - t0)


class Step:
    """The projections of every layer of one decode step, as plain matmuls over random weights."""

    def __init__(self, cfg: ModelConfig, layers: int, dev: torch.device):
        h, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, dtype=torch.bfloat16, device=dev) * 0.02

        self.weights = [
            {"qkv_proj": w(q + 2 * kv, h), "o_proj": w(h, q), "gate_up_proj": w(2 * inter, h), "down_proj": w(h, inter)}
            for _ in range(layers)
        ]
        self.q, self.inter = q, inter

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.weights for t in layer.values())

    def run(self, x: torch.Tensor, pool: LoRAPool | None, batch, cfg, side: torch.cuda.Stream | None, both=False):
        for i, layer in enumerate(self.weights):
            lora = pool.layers[i] if pool is not None else None

            def proj(name: str, inp: torch.Tensor) -> torch.Tensor:
                if lora is None:
                    return inp @ layer[name].t()
                if side is None:
                    y = inp @ layer[name].t()
                    triton_ops.add_lora(y, inp, lora[name], batch, cfg)
                    return y
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    partial = triton_ops.shrink(inp, lora[name], batch, cfg)
                    if both:  # the expand too, into its own buffer, added to y once both are done
                        z = torch.zeros(inp.shape[0], layer[name].shape[0], dtype=inp.dtype, device=inp.device)
                        triton_ops.expand(z, partial, lora[name], batch, cfg)
                y = inp @ layer[name].t()
                main.wait_stream(side)
                if both:
                    z.record_stream(main)
                    return y.add_(z)
                partial.record_stream(main)
                triton_ops.expand(y, partial, lora[name], batch, cfg)
                return y

            qkv = proj("qkv_proj", x)
            o = proj("o_proj", qkv[:, : self.q].contiguous())
            gu = proj("gate_up_proj", o)
            act = torch.nn.functional.silu(gu[:, : self.inter]) * gu[:, self.inter :]
            x = proj("down_proj", act)
        return x


def graph_ms(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / reps
    del graph
    return ms


def breakdown(step: Step, pool: LoRAPool, x: torch.Tensor, batch, adapters: int, reps: int, bandwidth: float, cfg):
    """Each projection's shrink and expand alone (one graph of every layer's launch): microseconds per launch and
    the share of the copy bandwidth that reading the adapters' weights reached."""
    inter = step.inter
    inputs = {
        "qkv_proj": x,
        "o_proj": torch.randn(x.shape[0], step.q, dtype=x.dtype, device=x.device),
        "gate_up_proj": x,
        "down_proj": torch.randn(x.shape[0], inter, dtype=x.dtype, device=x.device),
    }
    for name, inp in inputs.items():
        layers = [layer[name] for layer in pool.layers]
        hs = [triton_ops.shrink(inp, p, batch, cfg) for p in layers]
        y = inp.new_zeros(inp.shape[0], step.weights[0][name].shape[0])
        a_bytes = layers[0].a[0].nbytes * adapters
        b_bytes = layers[0].b[0].nbytes * adapters
        n = len(layers)
        ms_s = graph_ms(lambda: [triton_ops.shrink(inp, p, batch, cfg) for p in layers], reps) / n
        ms_e = graph_ms(lambda: [triton_ops.expand(y, h, p, batch, cfg) for p, h in zip(layers, hs)], reps) / n
        print(f"    {name:13s} shrink {ms_s * 1e3:6.1f} us ({a_bytes / (ms_s / 1e3) / bandwidth:4.0%} of copy bw), "
              f"expand {ms_e * 1e3:6.1f} us ({b_bytes / (ms_e / 1e3) / bandwidth:4.0%})", flush=True)  # fmt: skip


def graph_batch(bs: int, adapters: int, slots: int, dev: torch.device, m_split: int = 0) -> LoRABatch:
    """The segment table a CUDA graph of `bs` rows holds (padded to the pool's slots), rows sorted by adapter."""
    row_slots = sorted(i % adapters for i in range(bs))
    segments = []
    for slot in range(adapters):
        first = row_slots.index(slot)
        segments.append((first, row_slots.count(slot), slot))
    table = torch.zeros(3, slots, dtype=torch.int32)
    table[2].fill_(-1)
    for i, seg in enumerate(segments):
        table[:, i] = torch.tensor(seg)
    table = table.to(dev)
    return LoRABatch(segments, table[0], table[1], table[2], m_split=m_split or min(-(-bs // BLOCK_M), 8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--cases", nargs="+", default=["1x1", "64x1", "64x16"], help="BATCHxADAPTERS")
    p.add_argument("--layers", type=int, default=0, help="0: the config's")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--json", help="write the rows here too")
    p.add_argument(
        "--modes",
        nargs="+",
        default=["", " + side stream", " + side stream (both kernels)"],
        help="'': after the base matmul; ' + side stream': the shrink beside it; '... (both kernels)': as the server",
    )
    p.add_argument("--m-split", type=int, default=0, help="lanes per segment (0: as the server's graphs)")
    p.add_argument("--breakdown", action="store_true", help="also time each projection's kernels alone")
    args = p.parse_args()
    dev = torch.device("cuda")
    with open(args.config) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    layers = args.layers or cfg.num_layers
    cfg = dataclasses.replace(cfg, num_layers=layers)
    bandwidth = copy_bandwidth(dev)
    step = Step(cfg, layers, dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, {layers} layers", flush=True)
    side = torch.cuda.Stream()
    rows = []
    for rank in args.ranks:
        pool = LoRAPool(cfg, args.slots, rank, tuple(LORA_TARGET_MODULES), torch.bfloat16, dev)
        for layer in pool.layers:
            for proj in layer.values():
                proj.a.normal_(0, 0.02)
                proj.b.normal_(0, 0.02)
        per_adapter = pool.nbytes // args.slots
        for case in args.cases:
            bs, adapters = map(int, case.split("x"))
            x = torch.randn(bs, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
            batch = graph_batch(bs, adapters, args.slots, dev, args.m_split)
            base = graph_ms(lambda: step.run(x, None, None, None, None), args.reps)
            roof = (step.nbytes + adapters * per_adapter) / bandwidth * 1e3
            print(f"rank {rank} bs {bs} adapters {adapters}: base {base:.3f} ms, bytes roofline "
                  f"{roof / base:.3f}x base", flush=True)  # fmt: skip
            if args.breakdown:
                for name in args.variants:
                    print(f"  {name}:")
                    breakdown(step, pool, x, batch, adapters, args.reps, bandwidth, VARIANTS[name])
            for name in args.variants:
                for mode in args.modes:
                    kc = VARIANTS[name]
                    on_side, both = side if mode else None, "both" in mode
                    ms = graph_ms(lambda: step.run(x, pool, batch, kc, on_side, both), args.reps)
                    label = name + mode
                    rows.append({"rank": rank, "bs": bs, "adapters": adapters, "variant": label, "ms": ms,
                                 "base_ms": base, "ratio": ms / base, "roofline_ratio": roof / base})  # fmt: skip
                    print(f"  {label:48s} {ms:7.3f} ms  {ms / base:.3f}x", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
