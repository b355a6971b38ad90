"""What structured output costs, per real-world schema, through the HTTP server: constrained vs free decoding.

For each grammar of ``benchmarks/speed_suite/`` (JSON schemas that look like what users send, a regex and an
EBNF grammar) and each concurrency ``c`` of ``--concurrencies``:

1. *new grammar*: one free request, then one constrained request whose grammar the server has never seen (the
   schema gets a unique ``$comment``), their prompts' common prefix cached first: TTFT of each, and their ratio (the
   compile is in the constrained TTFT); ``--new-grammar-repeats`` pairs, the median ratio reported;
2. *constrained*: ``max(--min-requests, 2c)`` streamed chat completions (``response_format`` json_schema /
   ``regex`` / ``ebnf``, temperature ``--temperature``, ``max_tokens`` ``--max-tokens``) with at most ``c`` in
   flight; each output is checked (jsonschema / full regex match) unless cut at ``max_tokens``;
3. *free*: the same prompts unconstrained with ``ignore_eos`` and ``max_tokens`` = the completion tokens of the
   matching constrained request, so both runs decode the same lengths.

Steps 2 and 3 run ``--repeats`` times, alternating their order (c f, f c, ...) against the drift of a noisy machine,
after one free token per prompt has put every prompt in the prefix cache (so neither kind pays a prefill the other
does not).

Reported per (grammar, c): mean TPOT (per request: time from first to last token / (tokens - 1)) of each kind and
their ratio; the decode step's wall time of each kind and their ratio, from the server's own count
(``step_phases_ms.decode_steps`` of ``/get_server_info``, at the batch size where both kinds decoded most of their
tokens: a steadier figure than TPOT, which also holds the prefill steps, the client's load and the runs'
tails); output tok/s of each and their ratio, the grammar workers' fill time per reply and per step (deltas
of ``/get_server_info``), the compile time of the new grammar, the backend that served it, invalid and cut counts.

``--many N`` adds a run where every request has a different schema (N schemas of ``--corpus``, the MaskBench dev
splits), at ``--many-concurrency`` (default: the largest of ``--concurrencies``), against free requests of the same
lengths.

The server is started with ``--server-args`` (helpers of ``run_cpu_suite.py``) unless ``--base-url`` is given.
A markdown table (machine, date, exact command) is printed and, with every number, written to ``--output-dir``.

Example::

    python benchmarks/bench_schema_suite.py --concurrencies 1 16 --max-tokens 96
    python benchmarks/bench_schema_suite.py --base-url http://127.0.0.1:30000 --concurrencies 1 64 256 --many 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import aiohttp_session, iter_sse_data, machine_info, open_stream  # noqa: E402
from run_cpu_suite import Server, free_port  # noqa: E402

SUITE_DIR = HERE / "speed_suite"
DEFAULT_CORPUS = HERE.parent / ".." / "shared" / "corpora" / "jsonschemabench-dev"


@dataclass
class Grammar:
    name: str
    kind: str  # json_schema | regex | ebnf
    prompt: str
    grammar: Any  # a schema (dict) or grammar text

    def body_fields(self, tag: str = "") -> dict[str, Any]:
        """The request fields that constrain it; `tag` makes a schema new to the server (a `$comment`)."""
        if self.kind == "json_schema":
            schema = dict(self.grammar) if isinstance(self.grammar, dict) else self.grammar
            if tag and isinstance(schema, dict):
                schema["$comment"] = tag
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}
        if self.kind == "regex":
            return {"regex": self.grammar + (f"(#{tag})?" if tag else "")}
        if self.kind == "ebnf":
            return {"ebnf": self.grammar + (f'\nunused_{tag.replace("-", "_")} ::= "x"\n' if tag else "")}
        raise ValueError(self.kind)

    def check(self, text: str) -> Optional[str]:
        """None if `text` satisfies the grammar, else why not (EBNF outputs are not checked here)."""
        if self.kind == "json_schema":
            import jsonschema

            try:
                value = json.loads(text)
            except ValueError as e:
                return f"not JSON: {e}"
            # The schema's own draft and its formats (jsonschema.FormatChecker() holds every draft's, and draft 3's
            # "time" is strptime's "%H:%M:%S": it refuses RFC 3339 times with fractions or offsets).
            cls = jsonschema.validators.validator_for(self.grammar, default=jsonschema.Draft202012Validator)
            try:
                cls(self.grammar, format_checker=cls.FORMAT_CHECKER).validate(value)
            except jsonschema.ValidationError as e:
                return f"invalid: {e.message[:200]}"
            except jsonschema.SchemaError:
                return None  # the schema itself is outside what the validator takes; not the output's fault
            return None
        if self.kind == "regex":
            return None if re.fullmatch(self.grammar, text) else "no full match"
        return None


def load_suite(names: Optional[list[str]]) -> list[Grammar]:
    out = []
    for path in sorted(SUITE_DIR.glob("*.json")):
        if names and path.stem not in names:
            continue
        d = json.loads(path.read_text())
        out.append(Grammar(path.stem, d["kind"], d["prompt"], d["grammar"]))
    return out


def load_corpus(corpus: Path, n: int, seed: int) -> list[Grammar]:
    files = sorted(corpus.glob("*.json"))
    random.Random(seed).shuffle(files)
    out = []
    for path in files[:n]:
        d = json.loads(path.read_text())
        prompt = f"Write one JSON value for this description: {d.get('description') or path.stem}"[:400]
        out.append(Grammar(path.stem, "json_schema", prompt, d["schema"]))
    return out


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    tokens: int = 0
    finish: str = ""
    text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.ok and self.tokens > 1 else None


class Http:
    """httpx for the server's reports; aiohttp, where installed, for the streams (its CPU per streamed token is a
    third of httpx's: bench_serving.py)."""

    def __init__(self, client: httpx.AsyncClient, session=None):
        self.client = client
        self.session = session

    async def get(self, url: str, timeout: float = 60) -> httpx.Response:
        return await self.client.get(url, timeout=timeout)


async def chat(http: Http, url: str, body: dict[str, Any], timeout: float) -> Result:
    res = Result()
    t0 = time.perf_counter()
    parts: list[str] = []
    try:
        async with open_stream(url, body, http.client, http.session, timeout) as (status, error_body, lines):
            if status != 200:
                res.error = f"HTTP {status}: {error_body[:300]}"
                return res
            async for data in iter_sse_data(lines):
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = json.dumps(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"].get("completion_tokens") or 0
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        if not parts:
                            res.ttft = time.perf_counter() - t0
                        parts.append(delta)
                    if choice.get("finish_reason"):
                        res.finish = choice["finish_reason"]
    except Exception as e:  # noqa: BLE001 - every failure is a data point
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.latency = time.perf_counter() - t0
    res.text = "".join(parts)
    res.ok = bool(parts)
    if not res.ok:
        res.error = "no content"
    return res


def request_body(model: str, prompt: str, max_tokens: int, temperature: float, extra: dict[str, Any]) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def run_batch(
    http: Http, url: str, bodies: list[dict], concurrency: int, timeout: float
) -> tuple[list[Result], float]:
    """The results of `bodies` (in their order) with at most `concurrency` in flight, and the wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> Result:
        async with sem:
            return await chat(http, url, body, timeout)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(b) for b in bodies))
    return list(results), time.perf_counter() - t0


async def server_info(http: Http, base_url: str) -> dict[str, Any]:
    r = await http.get(base_url + "/get_server_info", timeout=60)
    return r.json() if r.status_code == 200 else {}


def grammar_delta(before: dict, after: dict) -> dict[str, Any]:
    tb, ta = before.get("grammar_timing") or {}, after.get("grammar_timing") or {}
    d = {k: ta.get(k, 0) - tb.get(k, 0) for k in ta if isinstance(ta.get(k), (int, float))}
    cb, ca = before.get("grammar_compiles") or {}, after.get("grammar_compiles") or {}
    backends_b, backends_a = cb.get("backends") or {}, ca.get("backends") or {}
    return {
        "fill_ms_per_reply": d["fill_ms"] / d["replies"] if d.get("replies") else None,
        "fill_ms_per_step": d["fill_ms"] / d["steps"] if d.get("steps") else None,
        "wait_after_forward_ms_per_step": d["wait_after_forward_ms"] / d["steps"] if d.get("steps") else None,
        "grammar_steps": d.get("steps"),
        "compiled": (ca.get("compiled", 0) - cb.get("compiled", 0)) if ca else None,
        "backends": {k: v - backends_b.get(k, 0) for k, v in backends_a.items() if v - backends_b.get(k, 0)},
    }


def phases_per_step(before: dict, after: dict) -> dict[str, float]:
    """The scheduler's host ms per step and phase (`step_phases_ms` of /get_server_info) between two reports."""
    pb, pa = before.get("step_phases_ms") or {}, after.get("step_phases_ms") or {}
    steps = pa.get("steps", 0) - pb.get("steps", 0)
    if steps <= 0:
        return {}
    return {
        k: round((v - pb.get(k, 0.0)) / steps, 4) for k, v in pa.items() if isinstance(v, (int, float)) and k != "steps"
    } | {"steps": steps}


def decode_cadence(before: dict, after: dict) -> dict[str, list[float]]:
    """Batch size (rounded up to a power of two) -> [steps, ms, rows] of the decode-only steps between two reports
    (`step_phases_ms.decode_steps.by_rows`: each step from its start to the next step's start, so prefill steps
    and idle waits are out)."""
    db = ((before.get("step_phases_ms") or {}).get("decode_steps") or {}).get("by_rows") or {}
    da = ((after.get("step_phases_ms") or {}).get("decode_steps") or {}).get("by_rows") or {}
    return {k: [a - b for a, b in zip(v, db.get(k, [0, 0.0, 0]))] for k, v in da.items()}


def add_cadence(total: dict[str, list[float]], part: dict[str, list[float]]) -> None:
    for k, v in part.items():
        total[k] = [a + b for a, b in zip(total.get(k, [0, 0.0, 0]), v)]


def compare_cadence(constrained: dict[str, list[float]], free: dict[str, list[float]]) -> dict[str, Any]:
    """Decode step ms of each kind at one batch size: the one where the smaller of the two kinds' token counts is
    largest."""
    if not constrained or not free:
        return {}
    size = max(constrained, key=lambda k: min(constrained[k][2], free.get(k, [0, 0.0, 0])[2]))
    c, f = constrained[size], free.get(size, [0, 0.0, 0])
    out = {"decode_batch_size": int(size), "decode_steps": [c[0], f[0]]}
    for kind, (steps, ms, rows) in (("constrained", c), ("free", f)):
        out[f"{kind}_decode_step_ms"] = ms / steps if steps else None
        out[f"{kind}_decode_rows"] = rows / steps if steps else None
    out["decode_step_ratio"] = ratio(out["constrained_decode_step_ms"], out["free_decode_step_ms"])
    return out


def mean(values: list[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


async def measure(
    http: Http,
    args: argparse.Namespace,
    model: str,
    grammars: list[Grammar],
    concurrency: int,
    label: str,
) -> dict[str, Any]:
    """Constrained requests (grammar i % len(grammars)), then free ones of the same lengths; one row."""
    url = args.base_url + "/v1/chat/completions"
    n = max(args.min_requests, 2 * concurrency)
    run_tag = uuid.uuid4().hex[:8]
    prompts = [f"{grammars[i % len(grammars)].prompt} (request {run_tag}-{i})" for i in range(n)]
    bodies = [
        request_body(model, prompts[i], args.max_tokens, args.temperature, grammars[i % len(grammars)].body_fields())
        for i in range(n)
    ]
    # The prompts go into the prefix cache first (one free token each): otherwise the kind that runs first pays
    # their prefill and the other never does (on the CPU that alone made constrained TTFT 1.6-1.8x free at c=16).
    warm = [request_body(model, p, 1, args.temperature, {"ignore_eos": True}) for p in prompts]
    await run_batch(http, url, warm, concurrency, args.timeout)
    # Repeats alternate the order (c f, f c, ...) to spread a noisy machine's drift over both kinds; the free
    # requests take the lengths of the first constrained run.
    constrained, free, c_wall, f_wall, free_bodies = [], [], 0.0, 0.0, None
    before = after = None
    c_phases: list[dict] = []
    c_by_repeat: list[float] = []  # mean TPOT ms of each repeat, in order (a cold first run shows itself)
    f_by_repeat: list[float] = []
    f_phases: list[dict] = []
    c_cadence: dict[str, list[float]] = {}  # the decode-only steps of each kind's runs (decode_cadence)
    f_cadence: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for kind in ("c", "f") if rep % 2 == 0 else ("f", "c"):
            which = "constrained" if kind == "c" else "free"
            print(f"[{label} c={concurrency}] {which} run {rep + 1}", file=sys.stderr, flush=True)
            if kind == "c":
                b0 = await server_info(http, args.base_url)
                res, wall = await run_batch(http, url, bodies, concurrency, args.timeout)
                a0 = await server_info(http, args.base_url)
                c_phases.append(phases_per_step(b0, a0))
                add_cadence(c_cadence, decode_cadence(b0, a0))
                before, after = before or b0, a0
                constrained += res
                c_by_repeat.append(round((mean([r.tpot for r in res]) or 0) * 1e3, 2))
                c_wall += wall
                if free_bodies is None:
                    free_bodies = [
                        request_body(
                            model,
                            prompts[i],
                            max(1, r.tokens or args.max_tokens),
                            args.temperature,
                            {"ignore_eos": True},
                        )
                        for i, r in enumerate(res)
                    ]
            else:
                b0 = await server_info(http, args.base_url)
                res, wall = await run_batch(http, url, free_bodies, concurrency, args.timeout)
                a0 = await server_info(http, args.base_url)
                f_phases.append(phases_per_step(b0, a0))
                add_cadence(f_cadence, decode_cadence(b0, a0))
                free += res
                f_by_repeat.append(round((mean([r.tpot for r in res]) or 0) * 1e3, 2))
                f_wall += wall
    invalid, errors = [], [r.error for r in constrained if not r.ok] + [r.error for r in free if not r.ok]
    cut = checked_out = 0
    for i, r in enumerate(constrained):
        if not r.ok:
            continue
        if r.finish == "length":
            cut += 1
            continue
        if r.finish == "invalid_output":  # caught by the server's last check (a streamed, relaxed schema): no success
            checked_out += 1
            continue
        why = grammars[i % n % len(grammars)].check(r.text)
        if why:
            invalid.append({"grammar": grammars[i % n % len(grammars)].name, "why": why, "text": r.text[:300]})
    c_tokens = sum(r.tokens for r in constrained if r.ok)
    f_tokens = sum(r.tokens for r in free if r.ok)
    row = {
        "grammar": label,
        "concurrency": concurrency,
        "requests": n,
        "repeats": args.repeats,
        "constrained_tpot_ms": (mean([r.tpot for r in constrained]) or 0) * 1e3,
        "free_tpot_ms": (mean([r.tpot for r in free]) or 0) * 1e3,
        "constrained_tpot_ms_by_repeat": c_by_repeat,
        "free_tpot_ms_by_repeat": f_by_repeat,
        "constrained_ttft_ms": (mean([r.ttft if r.ok else None for r in constrained]) or 0) * 1e3,
        "free_ttft_ms": (mean([r.ttft if r.ok else None for r in free]) or 0) * 1e3,
        "constrained_tok_s": c_tokens / c_wall,
        "free_tok_s": f_tokens / f_wall,
        "mean_tokens": c_tokens / max(1, sum(r.ok for r in constrained)),
        "cut": cut,
        "checked_out": checked_out,
        "invalid": len(invalid),
        "errors": len(errors),
        "invalid_examples": invalid[:3],
        "error_examples": errors[:3],
        **grammar_delta(before, after),
        # The scheduler's host ms per step by phase (the last run of each kind): where constrained steps spend more.
        "constrained_phases_ms": c_phases[-1] if c_phases else {},
        "free_phases_ms": f_phases[-1] if f_phases else {},
    }
    row["tpot_ratio"] = ratio(row["constrained_tpot_ms"], row["free_tpot_ms"])
    # The steadier figure: a decode step's wall time, constrained against free, at the same batch sizes.
    row.update(compare_cadence(c_cadence, f_cadence))
    row["tok_s_ratio"] = ratio(row["constrained_tok_s"], row["free_tok_s"])
    return row


async def new_grammar_ttft(http: Http, args: argparse.Namespace, model: str, g: Grammar) -> dict:
    """TTFT of a free request, then of a constrained one whose grammar is new to the server (compile included).
    A throwaway request first puts their common prompt prefix in the cache (the first request after a pause is also
    slow on its own), so both prefill the same few new tokens."""
    url = args.base_url + "/v1/chat/completions"
    tag = uuid.uuid4().hex[:12]
    warm = request_body(model, f"{g.prompt} ({tag}-w)", 1, 0.0, {"ignore_eos": True})
    await chat(http, url, warm, args.timeout)
    free_body = request_body(model, f"{g.prompt} ({tag}-f)", 4, 0.0, {"ignore_eos": True})
    first = await server_info(http, args.base_url)
    free = await chat(http, url, free_body, args.timeout)
    before = await server_info(http, args.base_url)
    body = request_body(model, f"{g.prompt} ({tag}-c)", 4, 0.0, g.body_fields(tag))
    new = await chat(http, url, body, args.timeout)
    after = await server_info(http, args.base_url)

    def grew(a: dict, b: dict, *keys: str) -> float | None:
        """How much a histogram's sum grew from report `a` to `b` (the one request's value)."""
        for key in keys:
            a, b = a.get(key) or {}, b.get(key) or {}
        return b["sum_ms"] - (a.get("sum_ms") or 0.0) if "sum_ms" in b else None

    return {
        "free_ttft_ms": free.ttft * 1e3 if free.ok else None,
        "new_grammar_ttft_ms": new.ttft * 1e3 if new.ok else None,
        "ttft_ratio": ratio(new.ttft if new.ok else None, free.ttft if free.ok else None),
        "compile_ms": grew(before, after, "grammar_compile_ms"),
        # The scheduler's share: waiting for the compile answer; from arrival there to the first token.
        "grammar_wait_ms": grew(before, after, "grammar_wait_ms"),
        "free_scheduler_first_token_ms": grew(first, before, "first_token_ms", "free"),
        "new_scheduler_first_token_ms": grew(before, after, "first_token_ms", "constrained"),
        "error": new.error or free.error,
    }


async def new_grammar_ttfts(http: Http, args: argparse.Namespace, model: str, g: Grammar) -> dict:
    """`new_grammar_ttft` --new-grammar-repeats times (a new grammar each time): the pair of median ratio, with the
    range of the ratios."""
    pairs = [await new_grammar_ttft(http, args, model, g) for _ in range(args.new_grammar_repeats)]
    ok = sorted((p for p in pairs if p["ttft_ratio"] is not None), key=lambda p: p["ttft_ratio"])
    if not ok:
        return pairs[0]
    median = ok[len(ok) // 2]
    return {**median, "ttft_ratios": [p["ttft_ratio"] for p in ok], "compile_ms_all": [p["compile_ms"] for p in ok]}


async def run_all(args: argparse.Namespace) -> tuple[list[dict], list[dict], dict]:
    rows, cold = [], []
    limits = httpx.Limits(
        max_connections=max(args.concurrencies) + 8, max_keepalive_connections=max(args.concurrencies) + 8
    )
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout) as client:
        session = aiohttp_session()
        http = Http(client, session)
        try:
            return await _run_all(args, http, rows, cold)
        finally:
            if session is not None:
                await session.close()


async def _run_all(args: argparse.Namespace, http: Http, rows: list[dict], cold: list[dict]):
    """The runs of `run_all` over its clients."""
    model = (await http.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
    # Warm-up: one free request and a trivial constrained one.
    url = args.base_url + "/v1/chat/completions"
    await chat(http, url, request_body(model, "Hello", 8, 0.0, {"ignore_eos": True}), args.timeout)
    await chat(http, url, request_body(model, "Yes?", 4, 0.0, {"regex": "(yes|no)"}), args.timeout)
    for g in load_suite(args.schemas):
        c = await new_grammar_ttfts(http, args, model, g)
        cold.append({"grammar": g.name, **c})
        print(f"[{g.name}] new grammar: {json.dumps(c)}", file=sys.stderr, flush=True)
        for conc in args.concurrencies:
            row = await measure(http, args, model, [g], conc, g.name)
            rows.append(row)
            print(
                f"[{g.name}] c={conc}: {json.dumps({k: v for k, v in row.items() if 'examples' not in k})}",
                file=sys.stderr,
                flush=True,
            )
    many = None
    if args.many:
        conc = args.many_concurrency or max(args.concurrencies)
        grammars = load_corpus(args.corpus, args.many, args.seed)
        saved, args.min_requests = args.min_requests, len(grammars)
        many = await measure(http, args, model, grammars, conc, f"many distinct ({len(grammars)} corpus schemas)")
        args.min_requests = saved
        rows.append(many)
        print(f"[many] {json.dumps({k: v for k, v in many.items() if 'examples' not in k})}", file=sys.stderr)
    info = await server_info(http, args.base_url)
    return rows, cold, info


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(meta: dict, rows: list[dict], cold: list[dict]) -> str:
    lines = [
        f"Machine: {meta['machine']}; date {meta['date']}.",
        f"Command: `{meta['command']}`",
        f"Server: `{meta['server']}`",
        "",
        "| grammar | c | TPOT constrained / free (ms) | ratio | decode step constrained / free (ms, batch) | ratio |"
        " TTFT constrained / free (ms) | tok/s constrained / free |"
        " ratio | fill ms/step | backend | mean tokens | cut | checked out | invalid | errors |",
        "|---|---:|---|---:|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['grammar']} | {r['concurrency']} | {fmt(r['constrained_tpot_ms'], '.1f')} / "
            f"{fmt(r['free_tpot_ms'], '.1f')} | **{fmt(r['tpot_ratio'])}** | "
            f"{fmt(r.get('constrained_decode_step_ms'), '.2f')} / {fmt(r.get('free_decode_step_ms'), '.2f')} "
            f"({fmt(r.get('constrained_decode_rows'), '.0f')} / {fmt(r.get('free_decode_rows'), '.0f')} rows) | "
            f"**{fmt(r.get('decode_step_ratio'))}** | {fmt(r['constrained_ttft_ms'], '.0f')} / "
            f"{fmt(r['free_ttft_ms'], '.0f')} | {fmt(r['constrained_tok_s'], '.0f')} / "
            f"{fmt(r['free_tok_s'], '.0f')} | {fmt(r['tok_s_ratio'])} | {fmt(r['fill_ms_per_step'], '.3f')} | "
            f"{', '.join(r['backends']) or '-'} | {fmt(r['mean_tokens'], '.0f')} | {r['cut']} | "
            f"{r.get('checked_out', 0)} | {r['invalid']} | {r['errors']} |"
        )
    lines += [
        "",
        "| grammar (new to the server) | compile ms | compile wait ms | TTFT free / new grammar (ms) | of which "
        "in the scheduler (ms) | ratio: median (all) |",
        "|---|---:|---:|---|---|---:|",
    ]
    for c in cold:
        lines.append(
            f"| {c['grammar']} | {fmt(c['compile_ms'], '.1f')} | {fmt(c.get('grammar_wait_ms'), '.1f')} | "
            f"{fmt(c['free_ttft_ms'], '.1f')} / {fmt(c['new_grammar_ttft_ms'], '.1f')} | "
            f"{fmt(c.get('free_scheduler_first_token_ms'), '.1f')} / "
            f"{fmt(c.get('new_scheduler_first_token_ms'), '.1f')} | "
            f"{fmt(c['ttft_ratio'])} ({', '.join(fmt(r) for r in c.get('ttft_ratios', []))}) |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start one with --server-args)")
    p.add_argument("--server-args", default="", help="arguments of `gramserve serve` for the server started here")
    p.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    p.add_argument("--schemas", nargs="*", default=None, help="names of speed_suite grammars (default: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="constrained / free runs per row, alternating the order")
    p.add_argument("--new-grammar-repeats", type=int, default=3, help="new-grammar TTFT pairs per grammar (median)")
    p.add_argument("--many", type=int, default=0, help="also run N distinct corpus schemas at once")
    p.add_argument("--many-concurrency", type=int, default=None, help="default: the largest of --concurrencies")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--output-dir", default=str(HERE / "results"))
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    server = None
    if args.base_url is None:
        os.makedirs(args.output_dir, exist_ok=True)
        port = free_port()
        server = Server(
            shlex.split(args.server_args), port, os.path.join(args.output_dir, "bench_schema_suite.server.log")
        )
        server.start(args.startup_timeout)
        args.base_url = server.base_url
    args.base_url = args.base_url.rstrip("/")
    try:
        rows, cold, info = asyncio.run(run_all(args))
    finally:
        if server is not None:
            server.stop()
    meta = {
        "machine": json.dumps(machine_info()),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "server": args.server_args if server is not None else args.base_url,
    }
    table = markdown(meta, rows, cold)
    print(table)
    os.makedirs(args.output_dir, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.output_dir, f"bench_schema_suite-{stamp}.json"), "w") as f:
        json.dump(
            {
                "meta": meta,
                "rows": rows,
                "new_grammar": cold,
                "server_info_end": {
                    k: info.get(k)
                    for k in ("settings", "grammar_compiles", "grammar_compile_ms", "grammar_fill_ms_per_reply")
                },
            },
            f,
            indent=1,
            default=str,
        )
    with open(os.path.join(args.output_dir, f"bench_schema_suite-{stamp}.md"), "w") as f:
        f.write(table + "\n")
    return 0 if not any(r["invalid"] or r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
