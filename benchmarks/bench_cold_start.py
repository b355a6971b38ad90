"""Cold start as a user sees it: time from launch to /health 200, then the first requests after ready against the
same requests once warm, with the warm-up (server/warmup.py) and without it (--skip-warmup), one after the other.

For each variant: start `gramserve serve` (``--server-args``), time /health; then send, one at a time, a plain
chat completion, one with a JSON-schema ``response_format``, and a burst of ``--burst`` chat completions at once;
then the same three again (warm). Prints a markdown table: seconds to ready, and each request's latency first /
warm with their ratio (the target: the first at most 2x a warm one).

Example (GPU, 1B shape)::

    python benchmarks/bench_cold_start.py --server-args "--model-path cfg.json --load-format dummy --tokenizer tok"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time

import httpx

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from run_cpu_suite import REPO_ROOT, Server, free_port  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
        "founded": {"type": "string", "format": "date"},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def chat_body(model: str, text: str, max_tokens: int, schema: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    return body


async def timed(client: httpx.AsyncClient, url: str, body: dict) -> float:
    t = time.perf_counter()
    r = await client.post(url, json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t


async def round_of_requests(base: str, max_tokens: int, burst: int, tag: str) -> dict[str, float]:
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient() as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        out = {}
        out["plain"] = await timed(client, url, chat_body(model, f"[{tag}] Name three rivers.", max_tokens, False))
        out["json_schema"] = await timed(client, url, chat_body(model, f"[{tag}] A city as JSON.", max_tokens, True))
        t = time.perf_counter()
        texts = [f"[{tag} {i}] Write a line about the number {i}." for i in range(burst)]
        await asyncio.gather(*(timed(client, url, chat_body(model, x, max_tokens, False)) for x in texts))
        out[f"burst of {burst}"] = time.perf_counter() - t
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--variants", default="warmup skip", help="warmup and/or skip (--skip-warmup)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rows = []
    for variant in args.variants.split():
        extra = ["--skip-warmup"] if variant == "skip" else []
        log = os.path.join(REPO_ROOT, "benchmarks", "results", f"cold_start_{variant}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        server = Server([*shlex.split(args.server_args), *extra], free_port(), log)
        server.start(timeout=1200)
        try:
            first = asyncio.run(round_of_requests(server.base_url, args.max_tokens, args.burst, "first"))
            warm = asyncio.run(round_of_requests(server.base_url, args.max_tokens, args.burst, "warm"))
        finally:
            server.stop()
        rows.append({"variant": variant, "ready_s": server.startup_s, "first": first, "warm": warm})
    print(f"\nCommand: {shlex.join([sys.executable, *sys.argv])}\n")
    print("| variant | ready s | request | first s | warm s | first / warm |")
    print("|---|---:|---|---:|---:|---:|")
    for row in rows:
        for name, first in row["first"].items():
            warm = row["warm"][name]
            print(
                f"| {row['variant']} | {row['ready_s']:.1f} | {name} | {first:.2f} | {warm:.2f} | {first / warm:.2f}x |"
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
