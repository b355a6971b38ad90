"""What serving LoRA adapters costs, through the HTTP server: TPOT with 1, 4, 16 distinct adapters in a batch.

For each rank of ``--ranks``, ``max(--adapters)`` random adapters of that rank (every q/k/v/o/gate/up/down projection
of every layer; ``lora_adapters.py``) are written and a server is started with all of them (``--lora-modules``,
``--max-loras-per-batch`` = the most adapters in one run). For each concurrency ``c`` of ``--concurrencies`` it then
runs, with ``max(2c, --min-requests)`` streamed completions at most ``c`` in flight (``--input-len`` random tokens,
``--output-len`` tokens with ``ignore_eos``, greedy):

- *base*: every request on the base model;
- *k adapters*, for each k of ``--adapters``: request i on adapter i mod k, so each batch mixes k adapters;
- *base again*: the base run once more (how much the server drifted over the runs).

Each concurrency first warms the server with a burst on the base model and one on the most adapters.

Reported: mean TPOT (per request, first to last token / (tokens - 1)) and output tok/s of each run, and the ratio
of each adapter run's TPOT to the base run's of the same server. ``--no-lora-baseline`` also starts a server without
LoRA and runs the base requests there (what the LoRA path costs requests that use no adapter).

Example (8B shape, dummy weights, on a GPU)::

    python benchmarks/bench_lora.py --config ../shared/models/llama-3.1-8b.json \\
        --server-args="--model ../shared/models/llama-3.1-8b.json --load-format dummy --tokenizer-path TOK" \\
        --ranks 16 64 --adapters 1 4 16 --concurrencies 1 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Client, RequestInput, machine_info  # noqa: E402
from lora_adapters import write_random_adapter  # noqa: E402
from run_cpu_suite import Server, free_port  # noqa: E402


def client_args(base_url: str) -> argparse.Namespace:
    """What bench_serving.Client reads from its command line."""
    return argparse.Namespace(
        base_url=base_url,
        extra_body=None,
        temperature=0.0,
        disable_ignore_eos=False,
        timeout=600.0,
        allow_missing_done=False,
    )


async def run(base_url: str, models: list[str], concurrency: int, reqs: list[RequestInput]) -> dict[str, Any]:
    """Each request on models[i % len(models)], at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 8)) as http:
        clients = [Client(client_args(base_url), m, http) for m in models]

        async def one(i: int, req: RequestInput):
            async with sem:
                return await clients[i % len(clients)].send(req, t0)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        duration = time.perf_counter() - t0
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    tpots = [r.tpot for r in results if r.tpot is not None]
    tokens = sum(r.output_tokens for r in results)
    return {
        "requests": len(results),
        "tpot_ms": 1e3 * sum(tpots) / len(tpots),
        "output_tok_s": tokens / duration,
        "ttft_ms": 1e3 * sum(r.ttft for r in results) / len(results),
    }


def requests(n: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[RequestInput]:
    rng = random.Random(seed)
    return [RequestInput([rng.randrange(100, vocab - 100) for _ in range(input_len)], output_len) for _ in range(n)]


def measure_server(server: Server, args, adapters: list[str], label: str) -> list[dict[str, Any]]:
    rows = []
    for c in args.concurrencies:
        n = max(2 * c, args.min_requests)
        reqs = requests(n, args.input_len, args.output_len, args.vocab, seed=c)
        runs = [("base", ["default"])] + [(f"{k} adapters", adapters[:k]) for k in args.adapters if adapters]
        for _, models in (runs[0], runs[-1]):  # warm this batch size, without and with adapters
            asyncio.run(run(server.base_url, models, c, reqs[: min(n, 2 * c)]))
        if adapters:
            runs.append(("base again", ["default"]))  # the drift of the server over the runs
        base = None
        for name, models in runs:
            out = asyncio.run(run(server.base_url, models, c, reqs))
            base = out["tpot_ms"] if name == "base" else base
            row = {"server": label, "concurrency": c, "run": name, **out, "tpot_vs_base": out["tpot_ms"] / base}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="", help="gramserve serve's arguments (model, device, ...)")
    p.add_argument("--config", default=None, help="the model's config.json (default: the default model's)")
    p.add_argument("--ranks", type=int, nargs="+", default=[16])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument(
        "--no-lora-baseline", action="store_true", help="also run the base requests on a server without LoRA"
    )
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    config_path = args.config
    if config_path is None:
        from gramserve.model.loader import resolve_model

        config_path = os.path.join(resolve_model(None)[0], "config.json")
    with open(config_path) as f:
        config = json.load(f)
    server_args = shlex.split(args.server_args)
    rows: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="bench-lora-")
    if args.no_lora_baseline:
        server = Server(server_args, free_port(), os.path.join(tmp, "server-no-lora.log"))
        server.start(args.startup_timeout)
        try:
            rows += measure_server(server, args, [], "no LoRA")
        finally:
            server.stop()
    for rank in args.ranks:
        names = []
        modules = []
        for i in range(max(args.adapters)):
            path = write_random_adapter(config, os.path.join(tmp, f"r{rank}-{i}"), rank, seed=i)
            names.append(f"lora{i}")
            modules.append(f"lora{i}={path}")
        lora_args = ["--lora-modules", *modules, "--max-loras-per-batch", str(max(args.adapters))]
        lora_args += ["--max-lora-rank", str(rank)]
        server = Server(server_args + lora_args, free_port(), os.path.join(tmp, f"server-r{rank}.log"))
        server.start(args.startup_timeout)
        try:
            rows += measure_server(server, args, names, f"LoRA rank {rank}")
        finally:
            server.stop()
    print("\n| server | c | run | TPOT ms | output tok/s | TPOT / base |\n|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['server']} | {r['concurrency']} | {r['run']} | {r['tpot_ms']:.2f} | {r['output_tok_s']:.0f} "
            f"| {r['tpot_vs_base']:.2f} |"
        )
    os.makedirs(args.output_dir, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = os.path.join(args.output_dir, f"lora-{stamp}.json")
    meta = {"command": shlex.join(sys.argv), "machine": machine_info(), "date": stamp}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
