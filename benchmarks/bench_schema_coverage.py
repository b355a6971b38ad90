"""Which schemas `auto` serves: per family, served exactly, served relaxed (checked and retried), refused.

Runs the grammar service of the server (``GrammarService``, backend ``auto``, the server's compile timeout and
compile worker processes) over every schema of one or more corpus folders, with the default model's tokenizer and
no model: a schema counts as served when the service answers with a backend, as refused when it answers with an
error (the 400 a client would get). The most common refusal reasons are listed per family.

Families: the corpus file prefixes (Glaiveai2K, Github_easy, ..., BFCL_* together, Feature_* together for the
JSON-Schema-Test-Suite written by feature_corpus.py).

Example::

    python benchmarks/feature_corpus.py --out /tmp/feature-corpus
    python benchmarks/bench_schema_coverage.py --corpus ../shared/corpora/jsonschemabench-dev /tmp/feature-corpus
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import machine_info  # noqa: E402

from gramserve.grammar.backends.base import GrammarOptions  # noqa: E402
from gramserve.grammar.service import GrammarService  # noqa: E402
from gramserve.messages import GrammarCompileReq, GrammarRequest  # noqa: E402
from gramserve.sampling.bitmask import allocate_bitmask  # noqa: E402
from tests.grammar_eval import category  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpora" / "jsonschemabench-dev"


def family(cat: str) -> str:
    for prefix in ("BFCL", "Feature"):
        if cat.startswith(prefix + "_"):
            return prefix
    return cat


def reason(error: str) -> str:
    """A short, countable form of a refusal: the last backend's message (the relaxed try when there was one)."""
    first = error.split("; ")[-1]
    first = re.sub(r"\(.*?\)", "", first)
    first = re.sub(r"\d+", "N", first)
    return first[:110]


def run(files: list[Path], in_flight: int, timeout_s: float) -> list[dict]:
    from transformers import AutoTokenizer

    from gramserve.model.loader import default_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    service = GrammarService(
        tok,
        len(tok),
        [tok.eos_token_id],
        GrammarOptions(),
        allocate_bitmask(8, len(tok)),
        compile_timeout_s=timeout_s,
        fill_threads=0,
    )
    rows: dict[str, dict] = {}
    todo = list(enumerate(files))
    live: dict[str, float] = {}
    try:
        while todo or live:
            while todo and len(live) < in_flight:
                i, path = todo.pop(0)
                doc = json.loads(path.read_text())
                rid = str(i)
                rows[rid] = {"file": path.name, "family": family(category(path))}
                live[rid] = time.monotonic()
                grammar = GrammarRequest("json_schema", json.dumps(doc["schema"]))
                resp = service.submit(GrammarCompileReq(rid, grammar))
                if resp is not None:
                    _record(service, rows, live, resp)
            for resp in service.poll_compiles():
                _record(service, rows, live, resp)
            time.sleep(0.002)
    finally:
        service.close()
    return list(rows.values())


def _record(service, rows, live, resp) -> None:
    row = rows[resp.rid]
    row["ms"] = round((time.monotonic() - live.pop(resp.rid)) * 1e3, 2)
    row["backend"] = resp.backend
    row["error"] = resp.error
    service.abort(resp.rid)  # drops its matcher


def summarize(rows: list[dict]) -> tuple[str, dict]:
    by_family: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_family[r["family"]].append(r)
    by_family["all"] = rows
    lines = [
        "| family | schemas | served exactly | served relaxed | refused | coverage |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for fam in sorted(by_family, key=lambda f: (f == "all", f)):
        rs = by_family[fam]
        exact = sum(1 for r in rs if r["backend"] and not r["backend"].endswith(":relaxed"))
        relaxed = sum(1 for r in rs if r["backend"] and r["backend"].endswith(":relaxed"))
        refused = len(rs) - exact - relaxed
        cov = (exact + relaxed) / len(rs)
        name = f"**{fam}**" if fam == "all" else fam
        lines.append(f"| {name} | {len(rs)} | {exact} | {relaxed} | {refused} | {cov:.1%} |")
        reasons = Counter(reason(r["error"]) for r in rs if r["error"])
        summary[fam] = {
            "schemas": len(rs),
            "exact": exact,
            "relaxed": relaxed,
            "refused": refused,
            "top_reasons": reasons.most_common(6),
            "backends": Counter(r["backend"] for r in rs if r["backend"]),
        }
    return "\n".join(lines), summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, nargs="+", default=[DEFAULT_CORPUS])
    p.add_argument("--limit", type=int, default=0, help="every k-th file so that about this many are run (0: all)")
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--timeout", type=float, default=5.0, help="the compile timeout (the server's default)")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    files = sorted(f for root in args.corpus for f in root.glob("*.json"))
    if args.limit and len(files) > args.limit:
        files = files[:: max(1, len(files) // args.limit)]
    t0 = time.monotonic()
    rows = run(files, args.in_flight, args.timeout)
    table, summary = summarize(rows)
    print(table)
    for fam, s in summary.items():
        if s["top_reasons"]:
            print(f"\n{fam}: refused for")
            for text, n in s["top_reasons"]:
                print(f"  {n:5d}  {text}")
    print(f"\n{len(rows)} schemas in {time.monotonic() - t0:.0f} s; {machine_info()}")
    print("command: python " + " ".join(sys.argv))
    if args.output:
        args.output.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
