"""Constrained vs unconstrained decoding throughput of gramserve, in one run with one server.

For each value of ``--concurrencies`` it sends ``--num-requests`` (default ``max(8, 2*c)``) chat completions
(``POST /v1/chat/completions``, not streamed, temperature 0, ``max_tokens`` = ``--max-tokens``) with at most
``c`` in flight, in two kinds:

* unconstrained: ``"ignore_eos": true``, so every request decodes exactly ``max_tokens`` tokens;
* constrained: ``response_format`` = ``json_schema`` with a schema whose valid outputs are long (by default an
  object whose required ``items`` array has at least 40 strings), so that these requests too run to
  ``max_tokens`` (``ignore_eos`` cannot be combined with a grammar). Each request's ``finish_reason`` is checked
  and the requests that ended before ``max_tokens`` are counted (and their JSON validated).

Both kinds use the same prompt text (it asks for a long JSON list), made unique per run and request so that
no run finds another run's whole prompt in the prefix cache. Throughput = sum of ``usage.completion_tokens``
of the successful requests / wall time of the batch. Run order, to spread the drift of a noisy machine over
both kinds: for each concurrency, ``u, c, c, u, ...`` (``--repeats`` pairs, every other one reversed); the table
shows the mean of the repeats and the ratio constrained / unconstrained (target >= 0.95). One unconstrained and
one constrained warm-up request (which compiles the schema) go first. Grammar-related counters of
``GET /get_server_info``
(grammar step timing, when the server exposes it) are reported as deltas per run.

The server is started and stopped with the helpers of ``run_cpu_suite.py``. A markdown table (machine, date,
exact command) is printed last; it and a JSON with every number are written to ``--output-dir``.

Example::

    python benchmarks/bench_structured.py                         # concurrencies 1 16 64, 64 tokens
    python benchmarks/bench_structured.py --concurrencies "1 4" --num-requests 4 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
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
from bench_serving import _short_error, compute_stats  # noqa: E402
from run_cpu_suite import (  # noqa: E402
    REPO_ROOT,
    Server,
    cpu_info,
    free_port,
    output_prefix,
    split_server_args,
    tail,
)

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 40}},
    "required": ["items"],
}
SYSTEM_PROMPT = "You are a helpful assistant that answers with JSON only."
USER_PROMPT = (
    'Request {tag}. Write a JSON object with one key, "items", whose value is a list of 100 different '
    "short English words (animals, colors, foods, tools, places). Do not stop before 100 words."
)
KINDS = ("unconstrained", "constrained")


# --------------------------------------------------------------------------- client


@dataclass
class ChatResult:
    success: bool = False
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: Optional[str] = None
    grammar_backend: Optional[str] = None
    latency: float = 0.0  # s
    content: str = ""
    error: str = ""


def request_body(kind: str, model: str, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT.format(tag=tag)},
        ],
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
    }
    if kind == "unconstrained":
        body["ignore_eos"] = True
    else:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "long_list", "schema": args.schema_obj},
        }
        if args.grammar_backend:
            body["grammar_backend"] = args.grammar_backend
    return body


async def send_chat(http: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> ChatResult:
    res = ChatResult()
    st = time.perf_counter()
    try:
        r = await http.post(url, json=body, timeout=timeout)
        res.latency = time.perf_counter() - st
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.text[:300]}"
            return res
        data = r.json()
        usage = data.get("usage") or {}
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        choice = (data.get("choices") or [{}])[0]
        res.finish_reason = choice.get("finish_reason")
        res.content = (choice.get("message") or {}).get("content") or ""
        res.grammar_backend = data.get("grammar_backend")
        if res.finish_reason == "abort":
            res.error = f"aborted: {res.content[:200]}"
        elif not usage:
            res.error = "no usage in the response"
        else:
            res.success = True
    except Exception as e:  # noqa: BLE001 - every failure is a data point
        res.latency = res.latency or time.perf_counter() - st
        res.error = _short_error(e)
    return res


def check_early_output(content: str, schema: dict[str, Any]) -> Optional[str]:
    """None if an output that ended before max_tokens is valid JSON (and satisfies the schema, when the
    jsonschema package is there); else why not."""
    try:
        value = json.loads(content)
    except ValueError as e:
        return f"not JSON: {e}"
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"schema violation: {e.message[:200]}"
    return None


# --------------------------------------------------------------------------- server counters


def flatten_numbers(d: Any, path: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            if not path and k == "server_args":
                continue
            out.update(flatten_numbers(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[path] = d
    return out


async def server_counters(http: httpx.AsyncClient, base_url: str) -> Optional[dict[str, float]]:
    try:
        r = await http.get(base_url + "/get_server_info", timeout=30)
        return flatten_numbers(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def counter_delta(before: Optional[dict[str, float]], after: Optional[dict[str, float]]) -> dict[str, Any]:
    """Grammar-related counters (changes during the run) and the scheduler's tokens per forward step."""
    if not before or not after:
        return {}
    delta = {k: after[k] - before.get(k, 0) for k in after}
    grammar = {
        k: v
        for k, v in delta.items()
        if ("grammar" in k.lower() or "mask" in k.lower()) and not k.rsplit(".", 1)[-1].startswith("num_")
    }
    out: dict[str, Any] = {"grammar": grammar}
    gen, steps = delta.get("stats.generation_tokens"), delta.get("stats.forward_steps")
    if gen is not None and steps:
        out["tokens_per_forward_step"] = gen / steps
    return out


def grammar_timing(grammar_delta: dict[str, float]) -> dict[str, float]:
    words = ("ms", "time", "second", "_s", "latency", "duration")
    return {k: v for k, v in grammar_delta.items() if any(w in k.lower() for w in words)}


# --------------------------------------------------------------------------- runs


async def one_batch(
    http: httpx.AsyncClient, base_url: str, model: str, kind: str, c: int, n: int, rep: int, args: argparse.Namespace
) -> dict[str, Any]:
    url = base_url + "/v1/chat/completions"
    sem = asyncio.Semaphore(c)
    bodies = [request_body(kind, model, f"c{c}-r{rep}-{kind[0]}-{i}", args) for i in range(n)]

    async def one(body: dict[str, Any]) -> ChatResult:
        async with sem:
            return await send_chat(http, url, body, args.timeout)

    before = await server_counters(http, base_url)
    t0 = time.perf_counter()
    results = list(await asyncio.gather(*(one(b) for b in bodies)))
    wall = time.perf_counter() - t0
    after = await server_counters(http, base_url)

    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    early = [r for r in ok if r.finish_reason != "length" or r.completion_tokens < args.max_tokens]
    early_invalid = [
        why
        for r in early
        if kind == "constrained" and (why := check_early_output(r.content, args.schema_obj)) is not None
    ]
    tout = sum(r.completion_tokens for r in ok)
    backends = sorted({r.grammar_backend for r in ok if r.grammar_backend})
    counters = counter_delta(before, after)
    row = {
        "kind": kind,
        "concurrency": c,
        "rep": rep,
        "num_requests": n,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "wall_s": wall,
        "completion_tokens": tout,
        "output_throughput": tout / max(wall, 1e-9),
        "request_throughput": len(ok) / max(wall, 1e-9),
        "latency_ms": dataclasses.asdict(compute_stats([r.latency for r in ok])),
        "ended_early": len(early),
        "finish_reasons": {fr: sum(1 for r in ok if r.finish_reason == fr) for fr in {r.finish_reason for r in ok}},
        "early_outputs_invalid": early_invalid,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else 0.0,
        "mean_cached_tokens": sum(r.cached_tokens for r in ok) / len(ok) if ok else 0.0,
        "grammar_backends": backends,
        "server_counters": counters,
        "sample_output": ok[0].content[:300] if ok else None,
    }
    print(
        f"[structured] c={c} rep={rep} {kind:>13}: {tout} tokens in {wall:.2f} s = "
        f"{row['output_throughput']:.1f} tok/s, {len(ok)}/{n} ok, {len(early)} ended early",
        file=sys.stderr,
        flush=True,
    )
    return row


async def run_all(base_url: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        r = await http.get(base_url + "/v1/models", timeout=30)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
        warm: dict[str, Any] = {}
        for kind in KINDS:  # the constrained one also compiles (and caches) the schema
            t0 = time.perf_counter()
            res = await send_chat(
                http, base_url + "/v1/chat/completions", request_body(kind, model, f"warmup-{kind}", args), args.timeout
            )
            if not res.success:
                raise RuntimeError(f"{kind} warm-up request failed: {res.error}")
            warm[kind] = {
                "latency_ms": (time.perf_counter() - t0) * 1000,
                "completion_tokens": res.completion_tokens,
                "finish_reason": res.finish_reason,
                "grammar_backend": res.grammar_backend,
                "output": res.content[:300],
            }
            print(
                f"[structured] warm-up {kind}: {res.completion_tokens} tokens, finish_reason "
                f"{res.finish_reason}, {warm[kind]['latency_ms']:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
        rows = []
        for c in args.concurrency_list:
            n = args.num_requests or max(8, 2 * c)
            for rep in range(args.repeats):
                # u c, then c u: a machine that drifts slower or faster over the run hurts both kinds alike
                for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
                    rows.append(await one_batch(http, base_url, model, kind, c, n, rep, args))
    return rows, warm


def aggregate(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for c in args.concurrency_list:
        entry: dict[str, Any] = {"concurrency": c}
        for kind in KINDS:
            rs = [r for r in rows if r["concurrency"] == c and r["kind"] == kind]
            tps = [r["output_throughput"] for r in rs]
            steps = [r["server_counters"].get("tokens_per_forward_step") for r in rs]
            timing: dict[str, float] = {}
            for r in rs:
                for k, v in grammar_timing(r["server_counters"].get("grammar", {})).items():
                    timing[k] = timing.get(k, 0) + v
            entry[kind] = {
                "num_requests": rs[0]["num_requests"] if rs else 0,
                "output_throughput_mean": sum(tps) / len(tps) if tps else None,
                "output_throughput_runs": tps,
                "failed": sum(r["failed"] for r in rs),
                "ended_early": sum(r["ended_early"] for r in rs),
                "requests": sum(r["num_requests"] for r in rs),
                "early_outputs_invalid": sum(len(r["early_outputs_invalid"]) for r in rs),
                "tokens_per_forward_step": (sum(steps) / len(steps)) if steps and None not in steps else None,
                "latency_p50_ms_mean": (sum(r["latency_ms"]["median"] for r in rs) / len(rs)) if rs else None,
                "grammar_backends": sorted({b for r in rs for b in r["grammar_backends"]}),
                "server_grammar_timing": timing,
            }
        u, k = entry["unconstrained"]["output_throughput_mean"], entry["constrained"]["output_throughput_mean"]
        entry["ratio_constrained_over_unconstrained"] = k / u if u and k is not None else None
        entry["ratio_runs"] = [
            kr["output_throughput"] / ur["output_throughput"] if ur["output_throughput"] else None
            for ur, kr in zip(
                [r for r in rows if r["concurrency"] == c and r["kind"] == "unconstrained"],
                [r for r in rows if r["concurrency"] == c and r["kind"] == "constrained"],
            )
        ]
        entry["target_met"] = (
            None
            if entry["ratio_constrained_over_unconstrained"] is None
            else entry["ratio_constrained_over_unconstrained"] >= args.target
        )
        out.append(entry)
    return out


# --------------------------------------------------------------------------- report


def fmt(v: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def build_markdown(meta: dict[str, Any], agg: list[dict[str, Any]], warm: dict[str, Any]) -> str:
    m = meta["machine"]
    cores = f"{m['logical_cpus']} logical CPUs"
    if m.get("physical_cores"):
        cores += f" ({m['physical_cores']} physical cores)"
    if m.get("usable_cpus") and m["usable_cpus"] != m["logical_cpus"]:
        cores += f", {m['usable_cpus']} usable"
    load = m.get("load_avg_1_5_15")
    backends = sorted({b for e in agg for b in e["constrained"]["grammar_backends"]})
    lines = [
        f"## gramserve constrained vs unconstrained decoding{' - ' + meta['label'] if meta['label'] else ''}",
        "",
        f"- machine: {m['cpu_model']}, {cores}; load avg at start "
        f"{' / '.join(f'{x:.2f}' for x in load) if load else 'n/a'}",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- workload: chat completions, max_tokens {meta['max_tokens']}, temperature 0, not streamed; unconstrained "
        f"with ignore_eos; constrained with response_format json_schema `{json.dumps(meta['schema'])}`, grammar "
        f"backend requested: {meta['grammar_backend'] or '(server default)'}, used: {', '.join(backends) or 'n/a'}; "
        f"order per concurrency: {' '.join(['u c', 'c u'][i % 2] for i in range(meta['repeats']))}, "
        f"mean of {meta['repeats']}; "
        f"server args: `{meta['server_args'] or '(none)'}`",
        "",
        "| concurrency | requests | unconstrained tok/s | constrained tok/s | constrained / unconstrained | "
        f"target >= {meta['target']:g} | constrained ended early | tok / forward step (u / c) |",
        "|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for e in agg:
        u, k = e["unconstrained"], e["constrained"]
        runs = lambda d: " / ".join(f"{x:.1f}" for x in d["output_throughput_runs"])  # noqa: E731
        verdict = {True: "yes", False: "NO", None: "n/a"}[e["target_met"]]
        fails = ""
        if u["failed"] or k["failed"]:
            fails = f" (failed: u {u['failed']}, c {k['failed']})"
        lines.append(
            f"| {e['concurrency']} | {u['num_requests']} x {meta['repeats']}{fails} | "
            f"{fmt(u['output_throughput_mean'])} ({runs(u)}) | {fmt(k['output_throughput_mean'])} ({runs(k)}) | "
            f"**{fmt(e['ratio_constrained_over_unconstrained'], '.3f')}** "
            f"({' / '.join(fmt(x, '.3f') for x in e['ratio_runs'])}) | {verdict} | "
            f"{k['ended_early']} / {k['requests']} | "
            f"{fmt(u['tokens_per_forward_step'], '.2f')} / {fmt(k['tokens_per_forward_step'], '.2f')} |"
        )
    lines.append("")
    lines.append("- tok/s = sum of completion tokens / wall time of the batch; in parentheses: each repeat.")
    timing = {k: v for e in agg for k, v in e["constrained"]["server_grammar_timing"].items()}
    if timing:
        for e in agg:
            t = e["constrained"]["server_grammar_timing"]
            lines.append(
                f"- server grammar timing, c={e['concurrency']} (sum over the constrained runs): "
                + ", ".join(f"{k}={v:.4g}" for k, v in sorted(t.items()))
            )
    else:
        lines.append("- server grammar step timing: not exposed by /get_server_info")
    for kind in KINDS:
        w = warm.get(kind)
        if w:
            lines.append(
                f"- warm-up {kind}: {w['completion_tokens']} tokens, finish_reason {w['finish_reason']}, "
                f"{w['latency_ms']:.0f} ms; output starts `{w['output'][:80]!r}`"
            )
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--concurrencies", default="1 16 64", help="space/comma separated max-concurrency values")
    p.add_argument("--num-requests", type=int, default=None, help="requests per run (default: max(8, 2*concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="u, c pairs per concurrency (mean reported)")
    p.add_argument(
        "--grammar-backend",
        default=None,
        help="sent as the request's grammar_backend (xgrammar, llguidance, outlines, auto); default: the server's",
    )
    p.add_argument(
        "--schema",
        default=None,
        help="JSON schema (JSON text) of the constrained requests; "
        "default: an object with a required array of >= 40 strings of <= 20 characters",
    )
    p.add_argument("--target", type=float, default=0.95, help="wanted constrained / unconstrained ratio")
    p.add_argument("--server-args", default="", help='passed through to "gramserve serve"')
    p.add_argument("--label", default="", help="free text, stored in the JSON and the table title")
    p.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request limit in seconds")
    args = p.parse_args(argv)
    try:
        args.concurrency_list = [int(x) for x in args.concurrencies.replace(",", " ").split()]
    except ValueError:
        p.error('--concurrencies must be integers, e.g. "1 16 64"')
    if not args.concurrency_list or min(args.concurrency_list) < 1:
        p.error("--concurrencies needs at least one value >= 1")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.max_tokens < 1 or args.repeats < 1:
        p.error("--max-tokens and --repeats must be >= 1")
    try:
        args.schema_obj = json.loads(args.schema) if args.schema else DEFAULT_SCHEMA
    except ValueError as e:
        p.error(f"--schema is not JSON: {e}")
    if not isinstance(args.schema_obj, dict):
        p.error("--schema must be a JSON object")
    args.server_argv = split_server_args(p, args.server_args)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.now().astimezone()
    prefix = output_prefix(args.output_dir, "structured", args.label, started)
    notes: list[str] = []
    meta: dict[str, Any] = {
        "benchmark": "structured",
        "label": args.label,
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": cpu_info(),
        "server_args": args.server_args,
        "concurrencies": args.concurrency_list,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "grammar_backend": args.grammar_backend,
        "schema": args.schema_obj,
        "target": args.target,
        "notes": notes,
    }
    rows: list[dict[str, Any]] = []
    warm: dict[str, Any] = {}
    rc = 0
    server = Server(args.server_argv, free_port(), prefix + "_server.log")
    try:
        server.start(args.startup_timeout)
        rows, warm = asyncio.run(run_all(server.base_url, args))
    except (RuntimeError, httpx.HTTPError, OSError) as e:
        rc = 1
        msg = str(e).splitlines()[0].replace("; log tail:", "") if str(e) else type(e).__name__
        last = [ln for ln in tail(server.log_path, 5).splitlines() if ln.strip()]
        notes.append(
            msg + (f"; last log line: `{last[-1].strip()[:200]}`" if last else "") + f" (log: {server.log_path})"
        )
        print(f"[structured] error: {e}", file=sys.stderr)
    finally:
        server.stop()
    meta["server"] = {
        "command": shlex.join(server.cmd),
        "log": server.log_path,
        "startup_s": server.startup_s,
        "exit_code": server.exit_code,
    }
    if server.sent_sigterm and server.exit_code not in (0, None):
        notes.append(f"server exited with code {server.exit_code} after SIGTERM")

    agg = aggregate(rows, args) if rows else []
    for e in agg:
        for kind in KINDS:
            d = e[kind]
            if d["failed"]:
                rc = 1
                errs = {
                    err
                    for r in rows
                    if r["concurrency"] == e["concurrency"] and r["kind"] == kind
                    for err in r["errors"]
                }
                notes.append(
                    f"c={e['concurrency']} {kind}: {d['failed']} of {d['requests']} requests failed: "
                    f"{next(iter(errs), '')[:160]}"
                )
            if kind == "unconstrained" and d["ended_early"]:
                notes.append(
                    f"c={e['concurrency']}: {d['ended_early']} unconstrained requests did not run to "
                    f"max_tokens despite ignore_eos"
                )
            if kind == "constrained" and d["ended_early"]:
                notes.append(
                    f"c={e['concurrency']}: {d['ended_early']} of {d['requests']} constrained requests "
                    f"ended before max_tokens ({d['early_outputs_invalid']} of them not valid for the "
                    f"schema): the two kinds did not decode the same number of tokens per request"
                )

    md = build_markdown(meta, agg, warm)
    with open(prefix + ".md", "w") as f:
        f.write(md)
    with open(prefix + ".json", "w") as f:
        json.dump({**meta, "warmup": warm, "summary": agg, "runs": rows}, f, indent=2, default=str)
        f.write("\n")
    print(f"[structured] wrote {prefix}.md, {prefix}.json and {prefix}_server.log", file=sys.stderr, flush=True)
    print()
    print(md, end="", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
