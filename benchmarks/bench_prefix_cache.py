"""Prefix-cache benchmark: a shared-prefix workload run against gramserve with and without the radix cache.

The workload is like SGLang's ``generated-shared-prefix`` dataset: ``--num-groups`` groups, each with a long
random "system prompt" (``--system-prompt-len`` random token ids in ``[--vocab-low, --vocab-high)``, seeded) and
``--prompts-per-group`` requests whose prompt is that system prompt followed by a short random question
(``--question-len`` tokens). Every request goes to ``POST /v1/completions`` with ``prompt`` as a list of token
ids, streaming with ``stream_options.include_usage``, temperature 0, ``ignore_eos`` and ``--output-len``
tokens, so TTFT (first streamed chunk with text) and ``usage.prompt_tokens_details.cached_tokens`` are known
per request.

In one run, strictly one after the other, it starts ``python -m gramserve serve`` twice (helpers of
``run_cpu_suite.py``): first with the prefix cache (default flags + ``--server-args``), then with
``--disable-radix-cache`` added. Each time it sends one warm-up request that shares no prefix with any group,
then the whole workload at ``--max-concurrency``, then stops the server. It reports for each: throughput
(req/s, output tok/s, total tok/s), TTFT mean/p50/p90, mean cached tokens per request, TTFT p50 of the requests
whose prefix was cached (``cached_tokens > 0``) and of the first request of each group; then the ratios
cache-off / cache-on. The target: TTFT at least 3x lower for the requests whose prefix is cached, compared
with the same requests when the cache is off.

A markdown table (machine, date, exact command) is printed last; it and a JSON with every number (and the
per-request data) are written to ``--output-dir`` next to both server logs.

Example::

    python benchmarks/bench_prefix_cache.py                       # 4 groups x 8, 1024 + 32 tokens, c=4
    python benchmarks/bench_prefix_cache.py --num-groups 2 --prompts-per-group 2 --system-prompt-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import httpx  # noqa: E402
from bench_serving import _short_error, compute_stats, iter_sse_data, percentile  # noqa: E402
from run_cpu_suite import (  # noqa: E402
    REPO_ROOT,
    Server,
    cpu_info,
    free_port,
    output_prefix,
    split_server_args,
    tail,
)

MODES = ("cache_on", "cache_off")


# --------------------------------------------------------------------------- workload


@dataclass
class PrefixRequest:
    idx: int  # position in the send order
    group: int
    index_in_group: int
    prompt_ids: list[int]
    output_len: int


@dataclass
class PrefixResult:
    idx: int
    group: int
    index_in_group: int
    success: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0  # s
    latency: float = 0.0  # s
    start_time: float = 0.0  # s since the start of the run
    finish_reason: Optional[str] = None
    error: str = ""


def build_workload(args: argparse.Namespace) -> tuple[list[PrefixRequest], list[int]]:
    """The requests in send order, and the warm-up prompt (which shares no first token with any group)."""
    rng = random.Random(args.seed)
    lo, hi = args.vocab_low, args.vocab_high
    systems = [[rng.randrange(lo, hi) for _ in range(args.system_prompt_len)] for _ in range(args.num_groups)]
    per_group = [
        [systems[g] + [rng.randrange(lo, hi) for _ in range(args.question_len)] for _ in range(args.prompts_per_group)]
        for g in range(args.num_groups)
    ]
    pairs = [(g, i) for g in range(args.num_groups) for i in range(args.prompts_per_group)]
    if args.order == "interleaved":
        pairs = [(g, i) for i in range(args.prompts_per_group) for g in range(args.num_groups)]
    elif args.order == "random":
        random.Random(args.seed + 3).shuffle(pairs)
    reqs = [
        PrefixRequest(idx=k, group=g, index_in_group=i, prompt_ids=per_group[g][i], output_len=args.output_len)
        for k, (g, i) in enumerate(pairs)
    ]

    # Warm-up: same total length, different seed, and a first token no group starts with, so that it can
    # never give a group a cache hit (the radix cache matches from the first token).
    wrng = random.Random(args.seed + 1_000_003)
    firsts = {s[0] for s in systems if s}
    warm = [wrng.randrange(lo, hi) for _ in range(args.system_prompt_len + args.question_len)]
    while warm[0] in firsts:
        warm[0] = wrng.randrange(lo, hi)
    return reqs, warm


# --------------------------------------------------------------------------- client


async def fetch_model(http: httpx.AsyncClient, base_url: str) -> str:
    r = await http.get(base_url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def server_info(http: httpx.AsyncClient, base_url: str) -> Optional[dict[str, Any]]:
    try:
        r = await http.get(base_url + "/get_server_info", timeout=30)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def send_request(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    prompt_ids: list[int],
    output_len: int,
    res: PrefixResult,
    t0: float,
    timeout: float,
) -> PrefixResult:
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    st = time.perf_counter()
    res.start_time = st - t0

    async def stream() -> None:
        got_text = got_done = False
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode('utf-8', 'replace')[:300]}"
                return
            async for data in iter_sse_data(resp.aiter_lines()):
                if data.strip() == "[DONE]":
                    got_done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if isinstance(chunk, dict) and chunk.get("error"):
                    res.error = "stream error: " + json.dumps(chunk["error"])[:300]
                    return
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                    if choice.get("text") and not got_text:
                        res.ttft = now - st
                        got_text = True
        res.latency = time.perf_counter() - st
        if not got_text:
            res.error = "no text chunk received"
        elif not got_done:
            res.error = "stream ended without data: [DONE]"
        elif not res.usage_reported:
            res.error = "no usage chunk (stream_options.include_usage ignored?)"
        else:
            res.success = True

    try:
        await asyncio.wait_for(stream(), timeout=timeout)
    except asyncio.TimeoutError:
        res.error = f"Timeout: request exceeded {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - every failure is a data point
        res.error = res.error or _short_error(e)
    if not res.latency:
        res.latency = time.perf_counter() - st
    return res


async def run_workload(
    base_url: str,
    reqs: list[PrefixRequest],
    warm: list[int],
    args: argparse.Namespace,
) -> tuple[list[PrefixResult], float, PrefixResult, Optional[dict], Optional[dict]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        model = await fetch_model(http, base_url)
        url = base_url + "/v1/completions"
        print(f"[prefix] warm-up request ({len(warm)} prompt tokens, no shared prefix)", file=sys.stderr, flush=True)
        wres = await send_request(
            http, url, model, warm, args.output_len, PrefixResult(-1, -1, -1), time.perf_counter(), args.timeout
        )
        if not wres.success:
            raise RuntimeError(f"warm-up request failed: {wres.error}")
        info_before = await server_info(http, base_url)
        sem = asyncio.Semaphore(args.max_concurrency)
        done = 0

        async def one(r: PrefixRequest, t0: float) -> PrefixResult:
            nonlocal done
            async with sem:
                res = await send_request(
                    http,
                    url,
                    model,
                    r.prompt_ids,
                    r.output_len,
                    PrefixResult(r.idx, r.group, r.index_in_group),
                    t0,
                    args.timeout,
                )
            done += 1
            print(
                f"\r[prefix]   {done}/{len(reqs)} done",
                end="\n" if done == len(reqs) else "",
                file=sys.stderr,
                flush=True,
            )
            return res

        print(f"[prefix] {len(reqs)} requests at max concurrency {args.max_concurrency}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        results = list(await asyncio.gather(*(one(r, t0) for r in reqs)))
        duration = time.perf_counter() - t0
        info_after = await server_info(http, base_url)
    return results, duration, wres, info_before, info_after


# --------------------------------------------------------------------------- summary


def p50_ms(values_s: list[float]) -> Optional[float]:
    return percentile(sorted(v * 1000 for v in values_s), 50) if values_s else None


def summarize(
    mode: str,
    results: list[PrefixResult],
    duration: float,
    args: argparse.Namespace,
    info_before: Optional[dict],
    info_after: Optional[dict],
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    dur = max(duration, 1e-9)
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.completion_tokens for r in ok)
    cached = [r for r in ok if r.cached_tokens > 0]
    first = [r for r in ok if r.index_in_group == 0]
    other = [r for r in ok if r.cached_tokens == 0 and r.index_in_group != 0]
    ttft = compute_stats([r.ttft for r in ok])
    prefix_stats = None
    if info_before and info_after:
        b, a = info_before.get("prefix_cache") or {}, info_after.get("prefix_cache") or {}
        prefix_stats = {
            "enabled": a.get("enabled"),
            **{k: a[k] - b.get(k, 0) for k in a if isinstance(a[k], (int, float)) and not isinstance(a[k], bool)},
        }
    return {
        "mode": mode,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "output_len_mismatches": sum(1 for r in ok if r.completion_tokens != args.output_len),
        "request_throughput": len(ok) / dur,
        "output_throughput": tout / dur,
        "total_token_throughput": (tin + tout) / dur,
        "ttft_ms": dataclasses.asdict(ttft),
        "e2e_ms": dataclasses.asdict(compute_stats([r.latency for r in ok])),
        "mean_cached_tokens": sum(r.cached_tokens for r in ok) / len(ok) if ok else 0.0,
        "cached_requests": len(cached),
        "ttft_p50_ms_cached": p50_ms([r.ttft for r in cached]),
        "ttft_p50_ms_first_of_group": p50_ms([r.ttft for r in first]),
        "first_of_group_requests": len(first),
        "ttft_p50_ms_other_uncached": p50_ms([r.ttft for r in other]),
        "other_uncached_requests": len(other),
        "server_prefix_cache_delta": prefix_stats,
    }


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def compare(
    on: dict[str, Any], off: dict[str, Any], res_on: list[PrefixResult], res_off: list[PrefixResult], target: float
) -> dict[str, Any]:
    """cache-off / cache-on ratios. The target compares the requests that hit the cache in the cache-on run
    with the very same requests (same prompt) in the cache-off run."""
    hit_idx = {r.idx for r in res_on if r.success and r.cached_tokens > 0}
    off_same = [r.ttft for r in res_off if r.success and r.idx in hit_idx]
    off_same_p50 = p50_ms(off_same)
    cached_ratio = ratio(off_same_p50, on["ttft_p50_ms_cached"])
    return {
        "request_throughput_off_over_on": ratio(off["request_throughput"], on["request_throughput"]),
        "output_throughput_off_over_on": ratio(off["output_throughput"], on["output_throughput"]),
        "total_token_throughput_off_over_on": ratio(off["total_token_throughput"], on["total_token_throughput"]),
        "ttft_mean_off_over_on": ratio(off["ttft_ms"]["mean"], on["ttft_ms"]["mean"]),
        "ttft_p50_off_over_on": ratio(off["ttft_ms"]["median"], on["ttft_ms"]["median"]),
        "ttft_p90_off_over_on": ratio(off["ttft_ms"]["p90"], on["ttft_ms"]["p90"]),
        "cache_off_ttft_p50_ms_same_requests": off_same_p50,
        "cached_requests_compared": len(off_same),
        "ttft_p50_cached_off_over_on": cached_ratio,
        "ttft_p50_first_over_cached_in_cache_on_run": ratio(on["ttft_p50_ms_first_of_group"], on["ttft_p50_ms_cached"]),
        "target": target,
        "target_met": None if cached_ratio is None else cached_ratio >= target,
    }


# --------------------------------------------------------------------------- report


def fmt(v: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def build_markdown(meta: dict[str, Any], modes: dict[str, dict[str, Any]], cmp: Optional[dict[str, Any]]) -> str:
    m = meta["machine"]
    cores = f"{m['logical_cpus']} logical CPUs"
    if m.get("physical_cores"):
        cores += f" ({m['physical_cores']} physical cores)"
    if m.get("usable_cpus") and m["usable_cpus"] != m["logical_cpus"]:
        cores += f", {m['usable_cpus']} usable"
    load = m.get("load_avg_1_5_15")
    w = meta["workload"]
    lines = [
        f"## gramserve prefix cache benchmark{' - ' + meta['label'] if meta['label'] else ''}",
        "",
        f"- machine: {m['cpu_model']}, {cores}; load avg at start "
        f"{' / '.join(f'{x:.2f}' for x in load) if load else 'n/a'}",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- workload: {w['num_groups']} groups x {w['prompts_per_group']} requests, shared system prompt "
        f"{w['system_prompt_len']} + question {w['question_len']} random tokens, {w['output_len']} output tokens "
        f"(ignore_eos, temperature 0), max concurrency {w['max_concurrency']}, order {w['order']}, seed "
        f"{w['seed']}; one warm-up request without shared prefix per server; server args: "
        f"`{meta['server_args'] or '(none)'}` (+ `--disable-radix-cache` for cache off)",
        "",
    ]
    on, off = modes.get("cache_on"), modes.get("cache_off")

    def val(d: Optional[dict], fn, spec: str = ".1f") -> str:
        if d is None:
            return "not run"
        if not d.get("completed"):
            return "FAILED"
        return fmt(fn(d), spec)

    rows = [
        ("requests ok / failed", lambda d: f"{d['completed']} / {d['failed']}", None, None),
        ("duration (s)", lambda d: d["duration_s"], ".2f", None),
        ("request throughput (req/s)", lambda d: d["request_throughput"], ".3f", "request_throughput_off_over_on"),
        ("output throughput (tok/s)", lambda d: d["output_throughput"], ".1f", "output_throughput_off_over_on"),
        (
            "total throughput (tok/s)",
            lambda d: d["total_token_throughput"],
            ".1f",
            "total_token_throughput_off_over_on",
        ),
        ("TTFT mean (ms)", lambda d: d["ttft_ms"]["mean"], ".1f", "ttft_mean_off_over_on"),
        ("TTFT p50 (ms)", lambda d: d["ttft_ms"]["median"], ".1f", "ttft_p50_off_over_on"),
        ("TTFT p90 (ms)", lambda d: d["ttft_ms"]["p90"], ".1f", "ttft_p90_off_over_on"),
        ("mean cached tokens / request", lambda d: d["mean_cached_tokens"], ".1f", None),
    ]
    lines += ["| metric | cache on | cache off | off / on |", "|---|---:|---:|---:|"]
    for name, fn, spec, key in rows:
        if spec is None:
            a = "not run" if on is None else fn(on)
            b = "not run" if off is None else fn(off)
        else:
            a, b = val(on, fn, spec), val(off, fn, spec)
        r = fmt(cmp.get(key), ".2f", "x") if cmp and key else ""
        lines.append(f"| {name} | {a} | {b} | {r} |")
    if on and on.get("completed"):
        n_c = on["cached_requests"]
        off_same = fmt(cmp["cache_off_ttft_p50_ms_same_requests"]) if cmp else "n/a"
        lines.append(
            f"| TTFT p50 (ms), cached-prefix requests (n={n_c} in cache-on run; cache off: same requests) "
            f"| {fmt(on['ttft_p50_ms_cached'])} | {off_same} | "
            f"**{fmt(cmp['ttft_p50_cached_off_over_on'] if cmp else None, '.2f', 'x')}** |"
        )
        first_on = on["ttft_p50_ms_first_of_group"]
        first_off = off["ttft_p50_ms_first_of_group"] if off and off.get("completed") else None
        lines.append(
            f"| TTFT p50 (ms), first request of each group (n={on['first_of_group_requests']}) | "
            f"{fmt(first_on)} | {fmt(first_off)} | {fmt(ratio(first_off, first_on), '.2f', 'x')} |"
        )
        if on["other_uncached_requests"]:
            lines.append(
                f"| TTFT p50 (ms), later requests without a cache hit (n={on['other_uncached_requests']}, "
                f"cache-on run) | {fmt(on['ttft_p50_ms_other_uncached'])} | | |"
            )
    lines.append("")
    if cmp:
        verdict = {True: "MET", False: "NOT MET", None: "n/a (no cached requests)"}[cmp["target_met"]]
        lines.append(
            f"- target (TTFT of cached-prefix requests >= {cmp['target']:g}x lower than the same requests "
            f"without the cache): **{fmt(cmp['ttft_p50_cached_off_over_on'], '.2f', 'x')} -> {verdict}**; "
            f"within the cache-on run, first-of-group / cached TTFT p50 = "
            f"{fmt(cmp['ttft_p50_first_over_cached_in_cache_on_run'], '.2f', 'x')}"
        )
    for mode, d in modes.items():
        ps = d.get("server_prefix_cache_delta")
        if ps:
            lines.append(
                f"- {mode} server prefix cache during the run: enabled={ps.get('enabled')}, "
                f"hit_tokens={ps.get('hit_tokens')}, query_tokens={ps.get('query_tokens')}"
            )
    lines.append("- off / on: for TTFT > 1 means the cache helps; for throughput < 1 means the cache helps.")
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--num-groups", type=int, default=4, help="groups, each with its own system prompt")
    p.add_argument("--prompts-per-group", type=int, default=8, help="requests per group")
    p.add_argument("--system-prompt-len", type=int, default=1024, help="shared prefix length, tokens")
    p.add_argument("--question-len", type=int, default=32, help="per-request suffix length, tokens")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument(
        "--order",
        default="grouped",
        choices=["grouped", "interleaved", "random"],
        help="send order: group after group (as SGLang's dataset), round-robin over groups, or shuffled",
    )
    p.add_argument("--vocab-low", type=int, default=100, help="lowest random token id (skips special tokens)")
    p.add_argument("--vocab-high", type=int, default=40000, help="random token ids are < this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=3.0, help="wanted cache-off / cache-on TTFT p50 of cached requests")
    p.add_argument("--server-args", default="", help='passed to both "gramserve serve" runs, e.g. "--dtype bfloat16"')
    p.add_argument("--modes", default="cache_on cache_off", help="which servers to run, in this order")
    p.add_argument("--label", default="", help="free text, stored in the JSON and the table title")
    p.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request limit in seconds")
    args = p.parse_args(argv)
    for name in (
        "num_groups",
        "prompts_per_group",
        "system_prompt_len",
        "question_len",
        "output_len",
        "max_concurrency",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.vocab_low < args.vocab_high:
        p.error("need 0 <= --vocab-low < --vocab-high")
    args.mode_list = args.modes.replace(",", " ").split()
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        p.error(f"--modes: each of {MODES}")
    args.server_argv = split_server_args(p, args.server_args)
    if "--disable-radix-cache" in args.server_argv:
        p.error("--server-args must not contain --disable-radix-cache (the cache-off run adds it)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.now().astimezone()
    prefix = output_prefix(args.output_dir, "prefix_cache", args.label, started)
    notes: list[str] = []
    reqs, warm = build_workload(args)
    meta: dict[str, Any] = {
        "benchmark": "prefix_cache",
        "label": args.label,
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": cpu_info(),
        "server_args": args.server_args,
        "workload": {
            k: getattr(args, k)
            for k in (
                "num_groups",
                "prompts_per_group",
                "system_prompt_len",
                "question_len",
                "output_len",
                "max_concurrency",
                "order",
                "seed",
                "vocab_low",
                "vocab_high",
            )
        },
        "notes": notes,
    }
    modes: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[PrefixResult]] = {}
    rc = 0
    for mode in args.mode_list:
        server_argv = args.server_argv + (["--disable-radix-cache"] if mode == "cache_off" else [])
        server = Server(server_argv, free_port(), f"{prefix}_{mode}_server.log")
        entry: dict[str, Any] = {"mode": mode}
        try:
            server.start(args.startup_timeout)
            results, duration, wres, ib, ia = asyncio.run(run_workload(server.base_url, reqs, warm, args))
            raw[mode] = results
            entry.update(summarize(mode, results, duration, args, ib, ia))
            entry["warmup"] = {
                "ttft_ms": wres.ttft * 1000,
                "latency_ms": wres.latency * 1000,
                "cached_tokens": wres.cached_tokens,
            }
            if entry["failed"]:
                rc = 1
                notes.append(
                    f"{mode}: {entry['failed']} of {entry['num_requests']} requests failed: "
                    f"{next(iter(entry['errors']), '')[:160]}"
                )
            if entry["output_len_mismatches"]:
                notes.append(
                    f"{mode}: {entry['output_len_mismatches']} requests did not return {args.output_len} tokens"
                )
            if mode == "cache_off" and entry["mean_cached_tokens"]:
                notes.append("cache_off: the server still reported cached tokens")
        except (RuntimeError, httpx.HTTPError, OSError) as e:
            rc = 1
            msg = str(e).splitlines()[0].replace("; log tail:", "") if str(e) else type(e).__name__
            last = [ln for ln in tail(server.log_path, 5).splitlines() if ln.strip()]
            notes.append(
                f"{mode}: {msg}"
                + (f"; last log line: `{last[-1].strip()[:200]}`" if last else "")
                + f" (log: {server.log_path})"
            )
            print(f"[prefix] {mode} error: {e}", file=sys.stderr)
            entry.update(completed=0, failed=len(reqs), error=msg)
        finally:
            server.stop()
        entry["server"] = {
            "command": shlex.join(server.cmd),
            "log": server.log_path,
            "startup_s": server.startup_s,
            "exit_code": server.exit_code,
        }
        if server.sent_sigterm and server.exit_code not in (0, None):
            notes.append(f"{mode}: server exited with code {server.exit_code} after SIGTERM")
        modes[mode] = entry

    cmp = None
    on, off = modes.get("cache_on"), modes.get("cache_off")
    if on and off and on.get("completed") and off.get("completed"):
        cmp = compare(on, off, raw["cache_on"], raw["cache_off"], args.target)
        if cmp["target_met"] is None:
            notes.append(
                "no request of the cache-on run had a cache hit: a group's requests were all in flight "
                "together; use --prompts-per-group > --max-concurrency (with --order grouped)"
            )

    md = build_markdown(meta, modes, cmp)
    record = {
        **meta,
        "results": modes,
        "comparison": cmp,
        "requests": {mode: [dataclasses.asdict(r) for r in rs] for mode, rs in raw.items()},
    }
    with open(prefix + ".md", "w") as f:
        f.write(md)
    with open(prefix + ".json", "w") as f:
        json.dump(record, f, indent=2, default=str)
        f.write("\n")
    print(f"[prefix] wrote {prefix}.md, {prefix}.json and the server logs {prefix}_*", file=sys.stderr, flush=True)
    print()
    print(md, end="", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
