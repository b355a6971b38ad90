"""Berkeley Function Calling Leaderboard (BFCL) questions against a running gramserve: valid-call rate and accuracy.

The questions ship in the ``bfcl-eval`` wheel (``bfcl_eval/data``). Its dependencies are heavy (and pin numpy),
so this script never installs it: it uses an installed ``bfcl_eval`` when there is one, else it runs
``pip download --no-deps bfcl-eval`` once into ``~/.cache/gramserve/bfcl`` and reads the JSON files from the wheel.

Per question (categories simple = simple_python, multiple, parallel, parallel_multiple) it sends one chat
completion with the question's functions as ``tools`` (BFCL parameter types mapped to JSON Schema: dict ->
object, float -> number, tuple -> array, any -> no constraint; dots in names become underscores, as BFCL's
OpenAI handler does), ``tool_choice`` = ``--tool-choice`` (default ``required``: constrained calls),
temperature 0, ``parallel_tool_calls`` false for simple and multiple (one call expected; ``--parallel`` to
allow several everywhere). It reports, per category:

* valid-call rate: calls whose arguments parse as JSON and validate against the tool's schema (jsonschema),
  over all calls returned; with constrained calls this must be 100%;
* answered: questions that got at least one call;
* exact-match accuracy, BFCL's AST rules: the set of calls matches the ground truth (same count; each call's
  function and every given parameter among the accepted values, optional ones may be left out; strings
  compared after BFCL's normalization, ints accepted for floats; parallel calls in any order).

Example (server already running, e.g. ``make serve``)::

    python benchmarks/bench_bfcl.py --limit 50 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from datetime import datetime
from itertools import permutations
from typing import Any

import httpx

CATEGORIES = {
    "simple": "simple_python",
    "multiple": "multiple",
    "parallel": "parallel",
    "parallel_multiple": "parallel_multiple",
}
CACHE = os.path.expanduser("~/.cache/gramserve/bfcl")
TYPE_MAP = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "integer": "integer",
    "string": "string",
    "boolean": "boolean",
    "array": "array",
    "object": "object",
    "number": "number",
}


# --------------------------------------------------------------------------- data


class BfclData:
    """Reads bfcl_eval/data/<name> from an installed package or from the downloaded wheel."""

    def __init__(self) -> None:
        try:
            import bfcl_eval  # type: ignore

            self.root = os.path.join(os.path.dirname(bfcl_eval.__file__), "data")
            self.zip = None
        except ImportError:
            self.root = None
            self.zip = zipfile.ZipFile(self._wheel())

    @staticmethod
    def _wheel() -> str:
        found = sorted(glob.glob(os.path.join(CACHE, "bfcl_eval-*.whl")))
        if not found:
            os.makedirs(CACHE, exist_ok=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", CACHE, "bfcl-eval"], check=True
            )
            found = sorted(glob.glob(os.path.join(CACHE, "bfcl_eval-*.whl")))
        return found[-1]

    def lines(self, name: str) -> list[dict]:
        if self.root is not None:
            with open(os.path.join(self.root, name)) as f:
                text = f.read()
        else:
            text = self.zip.read("bfcl_eval/data/" + name).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    @property
    def version(self) -> str:
        if self.zip is not None:
            return os.path.basename(self.zip.filename).split("-")[1]
        import bfcl_eval  # type: ignore

        return getattr(bfcl_eval, "__version__", "installed")


def to_json_schema(p: Any) -> Any:
    """BFCL's parameter description -> JSON Schema (recursively)."""
    if not isinstance(p, dict):
        return p
    out: dict[str, Any] = {}
    for k, v in p.items():
        if k == "type":
            if v == "any":
                continue
            out["type"] = TYPE_MAP.get(v, v)
        elif k == "properties" and isinstance(v, dict):
            out["properties"] = {name: to_json_schema(s) for name, s in v.items()}
        elif k == "items":
            out["items"] = to_json_schema(v)
        elif k in (
            "description",
            "enum",
            "required",
            "default",
            "format",
            "maximum",
            "minimum",
            "maxItems",
            "minItems",
            "pattern",
            "additionalProperties",
        ):
            out[k] = v
    if out.get("type") == "object" and "properties" in out and "required" in out:
        out["required"] = [r for r in out["required"] if r in out["properties"]]
    return out


def tool_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def tools_for(question: dict) -> tuple[list[dict], dict[str, str], dict[str, dict]]:
    tools, names, schemas = [], {}, {}
    for fn in question["function"]:
        name = tool_name(fn["name"])
        names[name] = fn["name"]
        schema = to_json_schema(fn.get("parameters") or {"type": "object", "properties": {}})
        schema.setdefault("type", "object")
        schemas[name] = schema
        tools.append(
            {
                "type": "function",
                "function": {"name": name, "description": fn.get("description", ""), "parameters": schema},
            }
        )
    return tools, names, schemas


# --------------------------------------------------------------------------- checking


def norm_str(s: str) -> str:
    return re.sub(r"[ ,./\-_*^]", "", s.lower()).replace("'", '"')


def value_ok(got: Any, accepted: list[Any]) -> bool:
    for want in accepted:
        if want == "":
            continue
        if isinstance(want, str) and isinstance(got, str) and norm_str(want) == norm_str(got):
            return True
        if isinstance(want, bool) or isinstance(got, bool):
            if want is got:
                return True
            continue
        if isinstance(want, (int, float)) and isinstance(got, (int, float)) and float(want) == float(got):
            return True
        if isinstance(want, (list, dict)) and _deep_equal(got, want):
            return True
    return False


def _deep_equal(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return norm_str(a) == norm_str(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def call_matches(name: str, args: dict, truth: dict) -> bool:
    ((fn, params),) = truth.items()
    if name != fn:
        return False
    for p, accepted in params.items():
        if p not in args:
            if "" not in accepted:
                return False
        elif not value_ok(args[p], accepted):
            return False
    return all(p in params for p in args)


def calls_match(calls: list[tuple[str, dict]], truths: list[dict]) -> bool:
    if len(calls) != len(truths):
        return False
    if len(calls) > 6:  # keep the permutation search small
        return all(call_matches(n, a, t) for (n, a), t in zip(calls, truths))
    return any(all(call_matches(n, a, t) for (n, a), t in zip(calls, perm)) for perm in permutations(truths))


# --------------------------------------------------------------------------- running


@dataclass
class CategoryResult:
    questions: int = 0
    answered: int = 0
    calls: int = 0
    valid_calls: int = 0
    correct: int = 0
    errors: int = 0
    finish_length: int = 0
    examples_invalid: list[str] = field(default_factory=list)


async def run_category(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    category: str,
    questions: list[dict],
    answers: dict,
    args: argparse.Namespace,
) -> CategoryResult:
    import jsonschema

    res = CategoryResult()
    sem = asyncio.Semaphore(args.concurrency)

    async def one(q: dict) -> None:
        tools, names, schemas = tools_for(q)
        body = {
            "model": model,
            "messages": q["question"][0],
            "tools": tools,
            "tool_choice": args.tool_choice,
            "temperature": 0,
            "max_tokens": args.max_tokens,
            # simple and multiple expect exactly one call: say so, as a client expecting one call would
            "parallel_tool_calls": args.parallel or category.startswith("parallel"),
        }
        async with sem:
            try:
                r = await http.post(url, json=body, timeout=600)
            except httpx.HTTPError as e:
                res.errors += 1
                res.examples_invalid.append(f"{q['id']}: {type(e).__name__}")
                return
        res.questions += 1
        if r.status_code != 200:
            res.errors += 1
            res.examples_invalid.append(f"{q['id']}: HTTP {r.status_code} {r.text[:200]}")
            return
        choice = r.json()["choices"][0]
        res.finish_length += choice["finish_reason"] == "length"
        calls = []
        for c in choice["message"].get("tool_calls") or []:
            res.calls += 1
            name = c["function"]["name"]
            try:
                a = json.loads(c["function"]["arguments"])
                jsonschema.validate(a, schemas[name])
            except (ValueError, KeyError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
                res.examples_invalid.append(f"{q['id']}: {name}: {str(e)[:150]}")
                continue
            res.valid_calls += 1
            calls.append((names[name], a))
        res.answered += bool(calls)
        res.correct += calls_match(calls, answers[q["id"]]["ground_truth"])

    await asyncio.gather(*(one(q) for q in questions))
    return res


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    data = BfclData()
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient() as http:
        model = (await http.get(base + "/v1/models", timeout=30)).json()["data"][0]["id"]
        results: dict[str, Any] = {"bfcl_version": data.version, "model": model, "categories": {}}
        for short in args.categories.split():
            name = CATEGORIES[short]
            qs = data.lines(f"BFCL_v4_{name}.json")
            answers = {a["id"]: a for a in data.lines(f"possible_answer/BFCL_v4_{name}.json")}
            if args.limit:
                step = max(1, len(qs) // args.limit)
                qs = qs[::step][: args.limit]
            t0 = time.perf_counter()
            res = await run_category(http, base + "/v1/chat/completions", model, short, qs, answers, args)
            results["categories"][short] = {**res.__dict__, "seconds": round(time.perf_counter() - t0, 1)}
            print(
                f"{short}: {res.questions} questions, valid calls {res.valid_calls}/{res.calls}, "
                f"accuracy {res.correct}/{res.questions}, errors {res.errors}",
                flush=True,
            )
    return results


def table(results: dict[str, Any], command: str) -> str:
    rows = [
        "| category | questions | answered | valid calls | valid-call rate | exact-match accuracy | "
        "hit max_tokens | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cat, r in results["categories"].items():
        rate = r["valid_calls"] / r["calls"] if r["calls"] else float("nan")
        acc = r["correct"] / r["questions"] if r["questions"] else float("nan")
        rows.append(
            f"| {cat} | {r['questions']} | {r['answered']} | {r['valid_calls']}/{r['calls']} | "
            f"{rate:.1%} | {acc:.1%} | {r['finish_length']} | {r['errors']} |"
        )
    head = (
        f"BFCL {results['bfcl_version']} against {results['model']}, {datetime.now():%Y-%m-%d %H:%M}, "
        f"command: `{command}`"
    )
    return head + "\n\n" + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--categories", default="simple multiple parallel parallel_multiple")
    ap.add_argument("--limit", type=int, default=0, help="questions per category, sampled evenly (0: all)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--tool-choice", default="required", choices=["required", "auto"])
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="parallel_tool_calls true for every category (default: only for the parallel ones)",
    )
    ap.add_argument("--output", default=None, help="write the JSON results here")
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results, "python " + " ".join(sys.argv)))


if __name__ == "__main__":
    main()
