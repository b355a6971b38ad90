"""Soak: thousands of mixed requests against one server, then check that nothing was lost or leaked.

Kinds, drawn at random: plain and streamed chat, JSON-schema chat (the speed suite's schemas, outputs validated),
tool calls, n > 1, /generate, multi-prompt completions, clients that abort a stream or disconnect while waiting,
and hostile bodies (bad values, malformed JSON) that must get a 4xx. Every request must end in the outcome its
kind expects; at the end the KV pool and the grammar slots must be whole and the server's memory must not have
grown past a bound. The figures go to docs/reliability.md.

    python benchmarks/soak.py --requests 2000 --concurrency 32          # starts `gramserve serve` itself
    python benchmarks/soak.py --url http://127.0.0.1:30000 --requests 500
    python benchmarks/soak.py --rounds 2 --requests 600      # memory after each round: growth past round 1 is a leak

The first round touches the KV pool's pages for the first time (the pool is allocated up front but the OS maps
its pages on first write), so the server's resident memory grows during it; later rounds should not grow it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import machine_info  # noqa: E402
from run_cpu_suite import Server, free_port  # noqa: E402

SUITE = Path(__file__).parent / "speed_suite"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PROMPTS = ["Hi!", "Name three fruits.", "What is 2+2?", "Write a haiku about rain.", "Describe a cat in JSON."]
HOSTILE: list[tuple[str, Any]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**64}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 10**30}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 10**6}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "bad"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "regex": "("}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "abc"}}),
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": -5}),
    ("/abort_request", {"rid": ["a"]}),
    ("/v1/chat/completions", b"[" * 50_000),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", b"{not json"),
]
KINDS = {  # kind: weight
    "plain": 20,
    "stream": 15,
    "schema": 20,
    "tools": 10,
    "n": 8,
    "generate": 7,
    "completions": 5,
    "abort_stream": 5,
    "disconnect": 5,
    "hostile": 5,
}


def load_schemas() -> list[dict]:
    out = []
    for path in sorted(SUITE.glob("*.json")):
        spec = json.loads(path.read_text())
        if spec.get("kind") == "json_schema":
            out.append(spec)
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (MB)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            pass
    return total / 1024


async def run_one(http: httpx.AsyncClient, kind: str, rng: random.Random, model: str, schemas: list[dict]) -> str:
    """The request's outcome: "ok", "client_abort", or what went wrong."""
    chat = {"model": model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    max_tokens = rng.randint(1, 48)
    if kind == "plain":
        r = await http.post("/v1/chat/completions", json={**chat, "max_tokens": max_tokens, "temperature": 1.0})
        return "ok" if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else f"http_{r.status_code}"
    if kind == "stream":
        body = {**chat, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        finished = any(c.get("finish_reason") for e in events for c in e.get("choices", []))
        errors = [e for e in events if "error" in e]
        return "ok" if lines[-1] == "data: [DONE]" and finished and not errors else "stream_incomplete"
    if kind == "schema":
        spec = rng.choice(schemas)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": spec["prompt"]}],
            "max_tokens": 96,
            "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": spec["grammar"]}},
        }
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return f"http_{r.status_code}"
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            import jsonschema

            try:
                jsonschema.validate(json.loads(choice["message"]["content"]), spec["grammar"])
            except (ValueError, jsonschema.ValidationError):
                return "invalid_output"
        return "ok"
    if kind == "tools":
        body = {**chat, "tools": [WEATHER], "tool_choice": rng.choice(["auto", "required"]), "max_tokens": 64}
        r = await http.post("/v1/chat/completions", json=body)
        return "ok" if r.status_code == 200 else f"http_{r.status_code}"
    if kind == "n":
        n = rng.randint(2, 4)
        r = await http.post("/v1/chat/completions", json={**chat, "n": n, "max_tokens": max_tokens})
        return "ok" if r.status_code == 200 and len(r.json()["choices"]) == n else f"http_{r.status_code}"
    if kind == "generate":
        body = {"text": rng.choice(PROMPTS), "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.8}}
        r = await http.post("/generate", json=body)
        return "ok" if r.status_code == 200 else f"http_{r.status_code}"
    if kind == "completions":
        body = {"model": model, "prompt": rng.sample(PROMPTS, 3), "max_tokens": max_tokens}
        r = await http.post("/v1/completions", json=body)
        return "ok" if r.status_code == 200 and len(r.json()["choices"]) == 3 else f"http_{r.status_code}"
    if kind == "abort_stream":
        body = {**chat, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # leaving mid-stream
        return "client_abort"
    if kind == "disconnect":
        try:
            await http.post("/v1/chat/completions", json={**chat, "max_tokens": 400, "ignore_eos": True}, timeout=0.5)
        except httpx.TimeoutException:
            return "client_abort"
        return "ok"
    path, body = rng.choice(HOSTILE)
    if isinstance(body, bytes):
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await http.post(path, json={"model": model, **body})
    ok = 400 <= r.status_code < 500 and "error" in r.json()
    return "ok" if ok else f"hostile_http_{r.status_code}"


async def soak(args: argparse.Namespace, base_url: str, server_pid: Optional[int]) -> dict:
    rng = random.Random(args.seed)
    schemas = load_schemas()
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
    outcomes: dict[str, Counter] = {k: Counter() for k in KINDS}
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        rss_start = tree_rss_mb(server_pid) if server_pid else None
        sem = asyncio.Semaphore(args.concurrency)
        deadline = time.monotonic() + args.duration
        t0 = time.monotonic()

        async def one(i: int, kind: str) -> None:
            async with sem:
                if time.monotonic() > deadline:
                    outcomes[kind]["not_sent"] += 1
                    return
                try:
                    own_rng = random.Random(args.seed * 100_003 + i)
                    outcomes[kind][await run_one(http, kind, own_rng, model, schemas)] += 1
                except Exception as exc:  # noqa: BLE001 - a lost request: counted, never fatal to the soak
                    outcomes[kind][f"exception_{type(exc).__name__}"] += 1

        await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)))
        elapsed = time.monotonic() - t0
        pool, info = {}, {}
        for _ in range(60):  # the pool is whole once every abort has reached the scheduler
            info = (await http.get("/get_server_info")).json()
            pool = info["kv_pool"]
            if pool["used_slots"] == 0 and pool["free_request_rows"] == pool["max_running_requests"]:
                break
            await asyncio.sleep(0.5)
        health = (await http.get("/health")).status_code
        rss_end = tree_rss_mb(server_pid) if server_pid else None
    lost = {k: {o: n for o, n in c.items() if o not in ("ok", "client_abort", "not_sent")} for k, c in outcomes.items()}
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "elapsed_s": round(elapsed, 1),
        "outcomes": {k: dict(c) for k, c in outcomes.items()},
        "lost_or_wrong": {k: v for k, v in lost.items() if v},
        "kv_pool_after": pool,
        "grammar_slots_in_use": info.get("grammar_slots_in_use"),
        "grammar_live_requests": info.get("grammar_live_requests"),
        "health_after": health,
        "server_rss_mb": {"start": rss_start, "end": rss_end},
        "output_checks": info.get("output_checks"),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `gramserve serve` here)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=1800, help="stop sending after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="run the soak this many times on the same server")
    p.add_argument("--server-args", default="", help="extra `gramserve serve` arguments, one string")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    server = None
    if args.url:
        base_url, pid = args.url, None
    else:
        port = free_port()
        server = Server(args.server_args.split(), port, f"/tmp/soak-server-{port}.log")
        server.start(timeout=600)
        base_url, pid = server.base_url, server.proc.pid
    rounds = []
    try:
        for r in range(args.rounds):
            rounds.append(asyncio.run(soak(argparse.Namespace(**{**vars(args), "seed": args.seed + r}), base_url, pid)))
    finally:
        if server is not None:
            server.stop()
    report = rounds[-1]
    if len(rounds) > 1:
        report["rounds"] = [{k: r[k] for k in ("elapsed_s", "lost_or_wrong", "server_rss_mb")} for r in rounds]
        report["lost_or_wrong"] = {i: r["lost_or_wrong"] for i, r in enumerate(rounds) if r["lost_or_wrong"]}
    report["machine"] = machine_info()
    report["command"] = " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    pool = report["kv_pool_after"]
    whole = pool.get("used_slots") == 0 and pool.get("free_request_rows") == pool.get("max_running_requests")
    return 0 if whole and not report["lost_or_wrong"] and report["health_after"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
