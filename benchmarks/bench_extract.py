"""Extraction throughput as a user runs it: `gramserve extract` over synthetic documents (extraction_docs.py), with
the prefix cache on and off, in one run, one after the other.

For each variant the command runs as a subprocess (start-up included in its wall time); its `--summary-json` gives
documents/s and output tokens/s over the job itself, the validity rate, the failures, and the share of prompt
tokens that came from the prefix cache. Prints a markdown table.

    python benchmarks/bench_extract.py --docs 300 --kind invoice                       # CPU, the default model
    python benchmarks/bench_extract.py --docs 10000 --kind invoice --max-tokens 256 \\
        --engine-args "--model cfg.json --load-format dummy --tokenizer tok"           # GPU, 8B shape
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)

from extraction_docs import synthetic_documents  # noqa: E402

VARIANTS = {"prefix cache on": [], "prefix cache off": ["--disable-radix-cache"]}


def run_variant(name: str, extra: list[str], args, docs_path: str, workdir: str) -> dict:
    out = os.path.join(workdir, f"{name.replace(' ', '_')}.jsonl")
    summary_path = out + ".summary.json"
    schema = os.path.join(REPO_ROOT, "schemas", f"{args.kind}.json")
    cmd = [sys.executable, "-m", "gramserve", "extract", "--schema", schema, "--input", docs_path, "--output", out]
    cmd += ["--max-tokens", str(args.max_tokens), "--summary-json", summary_path, "--no-progress", *extra]
    cmd += shlex.split(args.engine_args)
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.monotonic()
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if run.returncode not in (0, 1):
        raise SystemExit(f"{name}: exit {run.returncode}\n{run.stderr[-3000:]}")
    print(run.stderr.strip().splitlines()[-4:], flush=True)
    with open(summary_path) as f:
        summary = json.load(f)
    summary["wall_s"] = wall
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--kind", default="invoice", help="a schema of schemas/ (and the documents' kind)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--engine-args", default="", help="more `gramserve extract` options (model, device, ...)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which of: " + ", ".join(VARIANTS))
    parser.add_argument("--json-out", default=None, help="also write the results as JSON")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-extract-") as workdir:
        docs_path = os.path.join(workdir, "docs.jsonl")
        with open(docs_path, "w") as f:
            for doc in synthetic_documents(args.docs, seed=0, kinds=(args.kind,)):
                f.write(json.dumps(doc) + "\n")
        for name in args.variants.split(","):
            results[name] = run_variant(name, VARIANTS[name], args, docs_path, workdir)

    print(f"\n{args.docs} {args.kind} documents, max_tokens {args.max_tokens}, {args.engine_args or 'default model'}\n")
    print(
        "| variant | wall s (start-up incl.) | job s | documents/s | output tok/s | done | failed | validity | "
        "prompt tokens cached |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in results.items():
        cached = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        print(
            f"| {name} | {s['wall_s']:.1f} | {s['seconds']:.1f} | {s['documents_per_s']:.2f} | "
            f"{s['output_tokens_per_s']:.1f} | {s['done']} | {s['failed']} | {s['validity_rate']:.1%} | {cached:.0%} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
