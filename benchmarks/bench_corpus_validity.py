"""Valid by construction, over a whole corpus, through HTTP: per family, refused / valid / cut / invalid.

Every schema of the corpus folders goes to ``/v1/chat/completions`` as a ``response_format`` json_schema, at
temperature 1.0 (with random weights, an adversarial sampler that walks every branch a grammar allows), with
``--concurrency`` requests in flight. Each answer counts as:

* **refused**: a 400 (the schema cannot be served; the message says why);
* **valid**: finish_reason ``stop`` and the content validates (jsonschema, the schema's draft, formats checked);
* **cut**: finish_reason ``length`` (ran to max_tokens);
* **checked out**: finish_reason ``invalid_output``: the server's last check caught an output that broke the
  schema and no retry passed (only expected for schemas served relaxed);
* **invalid**: finish_reason ``stop`` but the content does not validate: a broken promise, the number that must be 0;
* **error**: a 5xx or a transport error.

With ``--as-tools`` each object schema is sent as the parameters of a tool ``f`` with ``tool_choice: "required"``
instead: valid means finish_reason ``tool_calls`` and every returned call validates (schemas that are not objects
count as skipped).

The served-relaxed count (``grammar_backend`` ``llguidance:relaxed``) and the server's ``output_checks`` (how often
the check fired, retries, recoveries) are reported too. With ``--base-url`` it uses a running server; otherwise it
starts one with ``--server-args`` (default: the tiny random-weight Llama of the tests on the default tokenizer).

Example::

    python benchmarks/feature_corpus.py --out /tmp/feature-corpus
    python benchmarks/bench_corpus_validity.py --corpus ../shared/corpora/jsonschemabench-dev /tmp/feature-corpus

Side by side with llama.cpp (llama-cpp-python's server on the default model's GGUF, restarted whenever a schema
crashes it; one request at a time, as it serves them)::

    while true; do python -m llama_cpp.server --model SmolLM2-135M-Instruct.Q4_1.gguf --n_ctx 4096 --port 8090; done &
    python benchmarks/bench_corpus_validity.py --llama-cpp --base-url http://127.0.0.1:8090 --concurrency 1 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_schema_coverage import family  # noqa: E402
from bench_serving import machine_info  # noqa: E402
from run_cpu_suite import Server, free_port  # noqa: E402

from tests.grammar_eval import category, instance_error  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpora" / "jsonschemabench-dev"
DEFAULT_SERVER = f"--model-path {ROOT / 'tests' / 'data' / 'tiny_llama.json'} --load-format dummy"
# A request that could not connect is tried again this many times, a second apart: with --llama-cpp the server runs in
# a restart loop, since llama-cpp-python's server dies on some schemas (its grammar parser aborts the process).
RECONNECTS = 60
OUTCOMES = ("refused", "valid", "cut", "checked out", "invalid", "error", "skipped")


async def one(http: httpx.AsyncClient, args, model: str, i: int, path: Path) -> dict:
    doc = json.loads(path.read_text())
    schema = doc["schema"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Give a JSON instance. {str(doc.get('description', ''))[:300]}"}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed * 1_000_003 + i,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    if args.llama_cpp:  # llama-cpp-python's server takes a schema only in this (pre-json_schema) spelling
        body["response_format"] = {"type": "json_object", "schema": schema}
        body["repeat_penalty"] = args.repetition_penalty  # always sent: its own default is 1.1
    elif args.repetition_penalty != 1.0:
        body["repetition_penalty"] = args.repetition_penalty
    row = {"file": path.name, "family": family(category(path))}
    if args.as_tools:  # the schema as a tool's parameters, the call forced
        if not (isinstance(schema, dict) and schema.get("type") == "object"):
            return {**row, "outcome": "skipped"}
        del body["response_format"]
        body["messages"][0]["content"] = f"Call the tool f. {str(doc.get('description', ''))[:300]}"
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    t0 = time.monotonic()
    for attempt in range(RECONNECTS + 1):
        try:
            r = await http.post(args.base_url + "/v1/chat/completions", json=body)
            break
        except httpx.ConnectError as exc:  # not sent: a server restarting after a crash (--llama-cpp) gets it again
            if attempt == RECONNECTS:
                return {**row, "outcome": "error", "detail": repr(exc)[:300]}
            await asyncio.sleep(1.0)
        except httpx.HTTPError as exc:
            return {**row, "outcome": "error", "detail": repr(exc)[:300]}
    row["s"] = round(time.monotonic() - t0, 3)
    if r.status_code == 400:
        return {**row, "outcome": "refused", "detail": r.json().get("error", {}).get("message", "")[:400]}
    if r.status_code != 200:
        return {**row, "outcome": "error", "detail": f"http {r.status_code}: {r.text[:300]}"}
    data = r.json()
    choice = data["choices"][0]
    content = choice["message"]["content"] or ""
    if args.as_tools:
        calls = [c["function"]["arguments"] for c in choice["message"].get("tool_calls") or []]
        content = calls[0] if calls else content  # the first call's arguments stand for the output (cut: its text)
        if choice["finish_reason"] == "tool_calls":
            choice["finish_reason"] = "stop"
            broken = [why for why in (instance_error(schema, a) for a in calls) if why]
            if not calls or broken:
                return {**row, "outcome": "invalid", "detail": broken[0] if broken else "no call", "content": calls}
    row["backend"] = data.get("grammar_backend")
    row["tokens"] = data["usage"]["completion_tokens"]
    finish = choice["finish_reason"]
    if finish == "length":
        return {**row, "outcome": "cut", "where": cut_site(content), "tail": content[-120:]}
    if finish == "invalid_output":
        return {**row, "outcome": "checked out", "detail": instance_error(schema, content)}
    if finish != "stop":
        return {**row, "outcome": "error", "detail": f"finish_reason {finish}"}
    why = instance_error(schema, content)
    return {**row, "outcome": "invalid" if why else "valid", "detail": why, "content": content[:500] if why else None}


async def run(args, files: list[Path]) -> tuple[list[dict], dict]:
    sem = asyncio.Semaphore(args.concurrency)
    done = 0

    async def bounded(http, model, i, path):
        nonlocal done
        async with sem:
            row = await one(http, args, model, i, path)
        done += 1
        if done % 200 == 0:
            print(f"  {done}/{len(files)}", flush=True)
        return row

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as http:
        model = (await http.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        rows = await asyncio.gather(*(bounded(http, model, i, p) for i, p in enumerate(files)))
        if args.llama_cpp:
            return list(rows), {}, {}
        info = (await http.get(args.base_url + "/get_server_info")).json()
    return list(rows), info.get("output_checks", {}), info.get("grammar_timing", {})


CUT_SITES = ("string", "key", "number", "whitespace", "array", "object", "other")


def cut_site(text: str) -> str:
    """Where an output cut at max_tokens was when it ran out: inside a string value, an object key, a number, a run
    of whitespace, between the items of an array or the members of an object (a model that keeps adding items)."""
    stack: list[str] = []  # open containers: "[" or "{"
    in_string = escaped = False
    string_is_key = False
    last_token = ""  # the kind of the last thing read outside strings
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string, last_token = False, "key" if string_is_key else "value"
            continue
        if ch == '"':
            in_string = True
            string_is_key = bool(stack) and stack[-1] == "{" and last_token in ("{", ",")
        elif ch in "[{":
            stack.append(ch)
            last_token = ch
        elif ch in "]}":
            if stack:
                stack.pop()
            last_token = "value"
        elif ch in ",:":
            last_token = ch
        elif not ch.isspace():
            last_token = "number"  # numbers, true / false / null
    if in_string:
        return "key" if string_is_key else "string"
    if text[-16:].isspace() and len(text) >= 16:
        return "whitespace"
    if last_token == "number":
        return "number"
    if stack:
        return "array" if stack[-1] == "[" else "object"
    return "other"


def cut_table(rows: list[dict]) -> str:
    """Where the cut outputs ran out, per family."""
    cut = [r for r in rows if r["outcome"] == "cut"]
    by: dict[str, list[dict]] = defaultdict(list)
    for r in cut:
        by[r["family"]].append(r)
    by["all"] = cut
    lines = ["| family | cut | " + " | ".join(CUT_SITES) + " |", "|---|" + "---:|" * (len(CUT_SITES) + 1)]
    for fam in sorted(by, key=lambda f: (f == "all", f)):
        n = {w: sum(r.get("where") == w for r in by[fam]) for w in CUT_SITES}
        name = f"**{fam}**" if fam == "all" else fam
        lines.append(f"| {name} | {len(by[fam])} | " + " | ".join(str(n[w]) for w in CUT_SITES) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["family"]].append(r)
    by["all"] = rows
    head = "| family | schemas | " + " | ".join(OUTCOMES) + " | served relaxed | valid of finished |"
    lines = [head, "|---|" + "---:|" * (len(OUTCOMES) + 3)]
    for fam in sorted(by, key=lambda f: (f == "all", f)):
        rs = by[fam]
        n = {o: sum(r["outcome"] == o for r in rs) for o in OUTCOMES}
        relaxed = sum(1 for r in rs if (r.get("backend") or "").endswith(":relaxed"))
        finished = n["valid"] + n["invalid"] + n["checked out"]
        share = f"{n['valid'] / finished:.1%}" if finished else "-"
        name = f"**{fam}**" if fam == "all" else fam
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(str(n[o]) for o in OUTCOMES) + f" | {relaxed} | {share} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, nargs="+", default=[DEFAULT_CORPUS])
    p.add_argument("--limit", type=int, default=0, help="every k-th file so that about this many are run (0: all)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument("--base-url")
    p.add_argument("--server-args", default=DEFAULT_SERVER)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--output-dir", default="benchmarks/results")
    p.add_argument(
        "--as-tools",
        action="store_true",
        help="send each object schema as the parameters of a tool with tool_choice required (others: skipped); "
        "valid: every returned call validates",
    )
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="--base-url is llama-cpp-python's server (python -m llama_cpp.server): send the schema its way",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="sent as repetition_penalty (gramserve, when not 1.0) or repeat_penalty (--llama-cpp, always: "
        "llama-cpp-python's own default is 1.1)",
    )
    args = p.parse_args()
    files = sorted(f for root in args.corpus for f in root.glob("*.json"))
    if args.limit and len(files) > args.limit:
        files = files[:: max(1, len(files) // args.limit)]
    os.makedirs(args.output_dir, exist_ok=True)
    server = None
    if args.base_url is None:
        log = os.path.join(args.output_dir, "bench_corpus_validity.server.log")
        server = Server(shlex.split(args.server_args), free_port(), log)
        server.start(args.startup_timeout)
        args.base_url = server.base_url
    args.base_url = args.base_url.rstrip("/")
    t0 = time.monotonic()
    try:
        rows, checks, grammar_timing = asyncio.run(run(args, files))
    finally:
        if server is not None:
            server.stop()
    wall = time.monotonic() - t0
    md = table(rows)
    print(md)
    print("\nWhere the cut outputs ran out:\n" + cut_table(rows))
    print(f"\noutput_checks: {checks}")
    print(f"grammar_timing: {grammar_timing}")
    for r in rows:
        if r["outcome"] in ("invalid", "error"):
            print(f"{r['outcome']}: {r['file']}: {r.get('detail')} {r.get('content') or ''}")
    print(f"\n{len(rows)} schemas in {wall:.0f} s; {machine_info()}")
    print("command: python " + " ".join(sys.argv) + (f"  (server: {args.server_args})" if server else ""))
    out = Path(args.output_dir) / f"bench_corpus_validity-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {"rows": rows, "output_checks": checks, "grammar_timing": grammar_timing, "wall_s": wall, "argv": sys.argv},
            indent=1,
        )
    )
    bad = sum(r["outcome"] in ("invalid", "error") for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
