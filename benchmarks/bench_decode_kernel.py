"""Our Triton decode-attention kernel against variants of its tile size, warps, pipeline stages and KV splits,
on the shapes of a throughput run's decode steps (Llama-3.1-8B: 32 query / 8 KV heads x 128, bf16, KV slots
scattered at random). GPU host only:

    python benchmarks/bench_decode_kernel.py [--cases 1x4096,256x600]

Prints, per (batch, KV length), the shipped configuration's time and KV read bandwidth and the four fastest
variants: whether tuning the kernel has anything left to give. Each variant is timed as a CUDA graph replay.
"""

from __future__ import annotations

import argparse

import torch
import triton

from gramserve.model.attention.triton_kernels import (
    _decode_merge_kernel,
    _decode_split_kernel,
    decode_splits,
    decode_tile,
)

HQ, HKV, D = 32, 8, 128
STAGES = 2  # as decode_attention launches the kernel (tile and warps: decode_tile)
CASES = ((1000, 300), (500, 450), (256, 600), (128, 800), (32, 1000), (1, 200), (1, 4096), (1, 32768))


def time_variant(q, k, v, table, rows, seq, block_n: int, warps: int, stages: int, splits: int) -> float:
    bs = q.shape[0]
    mid = torch.empty((bs, HQ, splits, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((bs, HQ, splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)

    def call():
        _decode_split_kernel[(bs, HKV, splits)](
            q,
            k,
            v,
            mid,
            lse,
            out,
            table,
            table.stride(0),
            rows,
            seq,
            D**-0.5,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            GROUP=HQ // HKV,
            BLOCK_H=16,
            D=D,
            BLOCK_N=block_n,
            IEEE=False,
            num_warps=warps,
            num_stages=stages,
        )
        if splits == 1:  # as decode_attention: one split writes the output, no merge
            return
        _decode_merge_kernel[(bs, HQ)](
            mid,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            SPLITS_P2=max(2, triton.next_power_of_2(splits)),
            D=D,
            num_warps=4,
        )

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    # Replayed from a CUDA graph, as the server's decode steps run it: GPU time, not Python launch time (which is
    # the larger part for a batch of one under ~4,096 KV tokens).
    return triton.testing.do_bench(graph.replay, warmup=20, rep=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(f"{bs}x{kv}" for bs, kv in CASES), help="BATCHxKV_LENGTH,...")
    cases = [tuple(int(x) for x in c.split("x")) for c in p.parse_args().cases.split(",")]
    dev = torch.device("cuda")
    slots = 600_000
    k = torch.randn(slots, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bs, kv in cases:
        table = torch.zeros(bs, max(kv, 4096), dtype=torch.int32, device=dev)
        table[:, :kv] = (torch.randperm(slots - 1, device=dev)[: bs * kv].to(torch.int32) + 1).view(bs, kv)
        rows, seq = torch.arange(bs, device=dev), torch.full((bs,), kv, device=dev)
        q = torch.randn(bs, HQ, D, device=dev, dtype=torch.bfloat16)
        shipped_splits = decode_splits(bs, HKV, sms)
        results = []
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    for splits in sorted({max(1, shipped_splits // 4), shipped_splits, 2 * shipped_splits}):
                        ms = time_variant(q, k, v, table, rows, seq, block_n, warps, stages, splits)
                        results.append((ms, (block_n, warps, stages, splits)))
        results.sort()
        gb = bs * kv * HKV * D * 2 * 2 / 1e9  # K and V bytes read

        def fmt(ms):
            return f"{ms * 1e3:.1f} us ({gb / ms * 1e3:.0f} GB/s)"

        shipped_cfg = (*decode_tile(bs * HKV, False), STAGES, shipped_splits)
        shipped = next(ms for ms, cfg in results if cfg == shipped_cfg)
        best = ", ".join(f"{fmt(ms)} {cfg}" for ms, cfg in results[:4])
        print(
            f"bs={bs} kv={kv}: shipped {fmt(shipped)} {shipped_cfg}; fastest (BLOCK_N, warps, stages, splits): {best}"
        )


if __name__ == "__main__":
    main()
