"""Offline baseline: HF transformers ``model.generate`` throughput on the same model and workload shape.

For each batch size B it builds B random token-id prompts of ``--input-len``
tokens (ids in [--vocab-low, --vocab-high), as in bench_serving.py), runs one
warmup, then ``--iters`` timed greedy generations of exactly ``--output-len``
new tokens (``min_new_tokens = max_new_tokens``, ``do_sample=False``), and
reports output tokens/s, total tokens/s and per-step latency (at batch 1 this
is the per-token latency). A separate timed generate of one token gives the
prefill time, so the decode-only time per token is shown too.

Example::

    python benchmarks/bench_hf_generate.py --batch-size 1 8 32 \\
        --input-len 256 --output-len 64 --iters 3 \\
        --output-json benchmarks/results/hf_generate.jsonl --append --label "hf fp32 cpu"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional


@dataclass
class HFResult:
    batch_size: int
    input_len: int
    output_len: int
    iters: int
    latencies_s: list[float] = field(default_factory=list)  # one whole generate() per iteration
    prefill_s: Optional[float] = None  # median time of a generate() with max_new_tokens=1
    mean_latency_s: float = 0.0
    output_throughput: float = 0.0  # output tok/s over all timed iterations
    total_token_throughput: float = 0.0  # (input + output) tok/s
    step_latency_ms: float = 0.0  # mean latency / output_len; per-token latency at batch 1
    decode_step_ms: Optional[float] = None  # (latency - prefill) / (output_len - 1)
    generated_lengths_ok: bool = True


def machine_info(torch_mod: Any) -> dict[str, Any]:
    import transformers

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch_mod.__version__,
        "torch_threads": torch_mod.get_num_threads(),
        "transformers": transformers.__version__,
    }


def run_one(model: Any, torch: Any, args: argparse.Namespace, batch_size: int, gen: Any) -> HFResult:
    device = next(model.parameters()).device
    input_ids = torch.randint(
        args.vocab_low, args.vocab_high, (batch_size, args.input_len), generator=gen, dtype=torch.long
    ).to(device)
    attention_mask = torch.ones_like(input_ids)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        eos = model.generation_config.eos_token_id
        pad_id = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)

    def generate(n_new: int) -> Any:
        with torch.inference_mode():
            return model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad_id,
            )

    res = HFResult(batch_size=batch_size, input_len=args.input_len, output_len=args.output_len, iters=args.iters)
    generate(args.output_len)  # warmup
    for _ in range(args.iters):
        t = time.perf_counter()
        out = generate(args.output_len)
        res.latencies_s.append(time.perf_counter() - t)
        if out.shape[1] - args.input_len != args.output_len:
            res.generated_lengths_ok = False
    if not args.no_prefill_probe:
        probes = []
        for _ in range(max(1, args.iters)):
            t = time.perf_counter()
            generate(1)
            probes.append(time.perf_counter() - t)
        res.prefill_s = statistics.median(probes)

    total = sum(res.latencies_s)
    res.mean_latency_s = total / len(res.latencies_s)
    res.output_throughput = batch_size * args.output_len * args.iters / total
    res.total_token_throughput = batch_size * (args.input_len + args.output_len) * args.iters / total
    res.step_latency_ms = res.mean_latency_s / args.output_len * 1000
    if res.prefill_s is not None and args.output_len > 1:
        res.decode_step_ms = max(0.0, res.mean_latency_s - res.prefill_s) / (args.output_len - 1) * 1000
    return res


def format_table(results: list[HFResult]) -> str:
    cols = ["batch", "in", "out", "latency s", "out tok/s", "total tok/s", "ms/step", "prefill ms", "decode ms/tok"]
    rows = []
    for r in results:
        rows.append(
            [
                str(r.batch_size),
                str(r.input_len),
                str(r.output_len),
                f"{r.mean_latency_s:.3f}",
                f"{r.output_throughput:.1f}",
                f"{r.total_token_throughput:.1f}",
                f"{r.step_latency_ms:.2f}",
                "-" if r.prefill_s is None else f"{r.prefill_s * 1000:.1f}",
                "-" if r.decode_step_ms is None else f"{r.decode_step_ms:.2f}",
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    out = ["", " HF generate baseline ".center(len(line), "="), line, "-" * len(line)]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    out.append("=" * len(line))
    out.append("ms/step = latency / output_len (the per-token latency at batch 1)")
    return "\n".join(out)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model-dir", default=None, help="HF model folder; default: gramserve's default model (cached)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="one or more batch sizes")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=3, help="timed iterations after one warmup")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=40000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads; default: all cores")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--no-prefill-probe", action="store_true", help="skip the 1-token generate that times prefill")
    p.add_argument("--output-json", default=None)
    p.add_argument("--append", action="store_true", help="append one JSON line per run (use a .jsonl path)")
    p.add_argument("--label", default="", help="free text stored in the JSON")
    args = p.parse_args(argv)
    if args.input_len < 1 or args.output_len < 1 or args.iters < 1 or min(args.batch_size) < 1:
        p.error("--input-len, --output-len, --iters and --batch-size must be >= 1")
    if args.vocab_high <= args.vocab_low:
        p.error("--vocab-high must be larger than --vocab-low")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.model_dir is None:
        from gramserve.model.loader import default_tokenizer_dir

        args.model_dir = default_tokenizer_dir()

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    model.to(args.device).eval()
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    if args.vocab_high > vocab:
        print(f"note: --vocab-high {args.vocab_high} > vocab size {vocab}; using {vocab}", file=sys.stderr)
        args.vocab_high = vocab
    print(
        f"model {args.model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params) "
        f"loaded in {load_s:.1f} s; device={args.device}, torch threads={torch.get_num_threads()}",
        file=sys.stderr,
    )

    gen = torch.Generator().manual_seed(args.seed)
    results = []
    for bs in args.batch_size:
        print(f"batch {bs}: warmup + {args.iters} iteration(s) ...", file=sys.stderr)
        r = run_one(model, torch, args, bs, gen)
        if not r.generated_lengths_ok:
            print(f"warning: batch {bs} did not generate exactly {args.output_len} tokens", file=sys.stderr)
        results.append(r)

    print(format_table(results))
    if args.output_json:
        record = {
            "benchmark": "hf_generate",
            "label": args.label,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "args": vars(args),
            "machine": machine_info(torch),
            "model_load_s": load_s,
            "results": [dataclasses.asdict(r) for r in results],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "a" if args.append else "w") as f:
            if args.append:
                f.write(json.dumps(record) + "\n")
            else:
                json.dump(record, f, indent=2)
                f.write("\n")
        print(f"results {'appended to' if args.append else 'written to'} {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
