"""Grammar backend benchmark on JSONSchemaBench (no model needed, only the tokenizer).

For each backend (xgrammar, llguidance, outlines) and each schema of the corpus (or a stratified
sample of ``--limit`` schemas): compile it (in a killable worker process, with a time limit; a
compile over the limit counts as a failure), then walk the test instances token by token through
a matcher, filling the bitmask before every token. Reports per backend:

* compile time p50/p90/p99/max over all schemas (a timed-out compile counts at its limit),
  compile failures (errors + timeouts),
* time to first mask (matcher creation + first ``fill_bitmask``) p50/p99,
* mask fill time per token p50/p99 (over the tokens of the valid instances),
* valid instances accepted and invalid instances rejected.

Example::

    python benchmarks/bench_grammar.py --limit 200 --output-json /tmp/bench_grammar.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CORPUS = REPO / ".." / "shared" / "corpora" / "jsonschemabench-dev"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def select_files(corpus: Path, limit: int | None) -> list[Path]:
    from tests.grammar_eval import corpus_files, stratified_sample

    files = corpus_files(corpus)
    if limit is None or limit >= len(files):
        return files
    every = max(1, math.ceil(len(files) / limit))
    sample = stratified_sample(files, every)
    return sample[:limit]


def summarize(name: str, results, seconds: float, timeout_s: float) -> dict:
    compile_all = [min(r.compile_s, timeout_s) if r.status == "timeout" else r.compile_s for r in results]
    compile_ok = [r.compile_s for r in results if r.status == "ok"]
    first = [r.first_mask_s for r in results if r.first_mask_s is not None]
    masks = [t for r in results for t in r.mask_s]
    ms = lambda v: None if v is None else round(v * 1000, 4)  # noqa: E731
    return {
        "backend": name,
        "schemas": len(results),
        "compiled": sum(r.status == "ok" for r in results),
        "compile_errors": sum(r.status == "error" for r in results),
        "compile_timeouts": sum(r.status == "timeout" for r in results),
        "compile_failures": sum(r.status != "ok" for r in results),
        "compile_ms": {
            "p50": ms(percentile(compile_all, 50)),
            "p90": ms(percentile(compile_all, 90)),
            "p99": ms(percentile(compile_all, 99)),
            "max": ms(max(compile_all) if compile_all else None),
            "mean_ok": ms(sum(compile_ok) / len(compile_ok) if compile_ok else None),
        },
        "first_mask_ms": {"p50": ms(percentile(first, 50)), "p99": ms(percentile(first, 99))},
        "mask_ms_per_token": {"p50": ms(percentile(masks, 50)), "p99": ms(percentile(masks, 99)), "tokens": len(masks)},
        "valid_accepted": sum(r.valid_accepted for r in results),
        "valid_total": sum(r.valid_total for r in results),
        "invalid_rejected": sum(r.invalid_rejected for r in results),
        "invalid_total": sum(r.invalid_total for r in results),
        "wall_s": round(seconds, 1),
        "failures": [{"file": r.path, "status": r.status, "error": r.error[:300]} for r in results if r.status != "ok"],
    }


def print_table(rows: list[dict]) -> None:
    cols = [
        ("backend", lambda r: r["backend"]),
        ("schemas", lambda r: r["schemas"]),
        ("fail(err/to)", lambda r: f"{r['compile_failures']} ({r['compile_errors']}/{r['compile_timeouts']})"),
        ("compile p50", lambda r: _f(r["compile_ms"]["p50"])),
        ("p90", lambda r: _f(r["compile_ms"]["p90"])),
        ("p99", lambda r: _f(r["compile_ms"]["p99"])),
        ("max", lambda r: _f(r["compile_ms"]["max"])),
        ("1st mask p50", lambda r: _f(r["first_mask_ms"]["p50"])),
        ("p99", lambda r: _f(r["first_mask_ms"]["p99"])),
        ("mask/tok p50", lambda r: _f(r["mask_ms_per_token"]["p50"])),
        ("p99", lambda r: _f(r["mask_ms_per_token"]["p99"])),
        ("valid ok", lambda r: f"{r['valid_accepted']}/{r['valid_total']}"),
        ("invalid rej", lambda r: f"{r['invalid_rejected']}/{r['invalid_total']}"),
        ("wall s", lambda r: r["wall_s"]),
    ]
    table = [[h for h, _ in cols]] + [[str(fn(r)) for _, fn in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print("times in ms")
    for i, row in enumerate(table):
        print("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _f(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.0f}" if v >= 1000 else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--backends", nargs="+", default=None, help="default: all")
    p.add_argument("--limit", type=int, default=None, help="a stratified sample of N schemas (default: all)")
    p.add_argument("--timeout", type=float, default=10.0, help="compile time limit per schema, seconds")
    p.add_argument("--max-whitespace", type=int, default=2, help="GrammarOptions.max_whitespace (-1: unbounded)")
    p.add_argument("--extra-vocab", type=int, default=0, help="logits columns beyond the tokenizer vocabulary")
    p.add_argument("--max-instances", type=int, default=None, help="test instances walked per schema")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from gramserve.grammar.backends import BACKEND_NAMES, GrammarOptions
    from gramserve.model.loader import default_tokenizer_dir
    from tests.grammar_eval import run_corpus

    if not args.corpus.is_dir():
        print(f"corpus not found: {args.corpus}", file=sys.stderr)
        return 2
    files = select_files(args.corpus, args.limit)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    eos = [tokenizer.eos_token_id]
    vocab_size = len(tokenizer) + args.extra_vocab
    options = GrammarOptions(max_whitespace=None if args.max_whitespace < 0 else args.max_whitespace)
    names = args.backends or list(BACKEND_NAMES)
    print(
        f"{len(files)} schemas from {args.corpus.resolve()}, backends {', '.join(names)}, vocab_size {vocab_size}, "
        f"compile limit {args.timeout:g} s, {os.cpu_count()} CPUs",
        flush=True,
    )

    rows = []
    for name in names:
        done = [0]
        t0 = time.monotonic()

        def progress(r, name=name, done=done, t0=t0):
            done[0] += 1
            if not args.quiet and (done[0] % 50 == 0 or done[0] == len(files)):
                print(f"  {name}: {done[0]}/{len(files)} ({time.monotonic() - t0:.0f} s)", flush=True)

        results = run_corpus(
            name,
            tokenizer,
            vocab_size,
            eos,
            options,
            files,
            timeout_s=args.timeout,
            time_masks=True,
            max_instances=args.max_instances,
            progress=progress,
        )
        rows.append(summarize(name, results, time.monotonic() - t0, args.timeout))

    print()
    print_table(rows)
    if args.output_json:
        from importlib.metadata import version

        import llguidance

        doc = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "corpus": str(args.corpus.resolve()),
            "files": len(files),
            "options": vars(options),
            "vocab_size": vocab_size,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "versions": {k: version(k) for k in ("xgrammar", "llguidance", "outlines_core", "torch", "transformers")},
            "llguidance_build": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
            "results": rows,
        }
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
