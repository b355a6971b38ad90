"""What `auto` chooses between: compile time and mask-fill cost per backend, with the tokenizer only (no model).

1. For each grammar of ``benchmarks/speed_suite/`` and each backend (``--backends``): the compile time (through the
   service's compile: the schema audit, then the backend), then a seeded random walk through allowed tokens (what
   dummy weights at temperature 1 do), restarted when the grammar ends, timing every mask fill (thread CPU time):
   p50 / p99 / max us per row over ``--steps`` fills. The walk runs twice and the second is reported (llguidance
   builds lexer states lazily; a server's later requests see the warm cost).
2. Compile time over ``--corpus-schemas`` schemas of ``../shared/corpora/jsonschemabench-dev`` (every k-th file), per
   backend: p50 / p90 / p99 / max ms and how many compiled (refusals by the audit or the backend are counted apart).

Example::

    python benchmarks/bench_backend_choice.py --steps 400 --corpus-schemas 1000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_serving import machine_info  # noqa: E402

from gramserve.grammar.backends import create_backend  # noqa: E402
from gramserve.grammar.backends.base import GrammarCompileError, GrammarOptions  # noqa: E402
from gramserve.grammar.compile_process import compile_grammar  # noqa: E402
from gramserve.grammar.fill_probe import random_allowed_token  # noqa: E402
from gramserve.messages import GrammarRequest  # noqa: E402
from gramserve.sampling.bitmask import allocate_bitmask  # noqa: E402

SUITE = REPO / "benchmarks" / "speed_suite"
CORPUS = REPO.parent / "shared" / "corpora" / "jsonschemabench-dev"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def grammar_text(d: dict) -> str:
    return json.dumps(d["grammar"]) if d["kind"] == "json_schema" else d["grammar"]


def walk_fill_us(backend, compiled, steps: int, seed: int = 0) -> list[float]:
    bitmask = allocate_bitmask(1, backend.vocab_size)
    row = bitmask[0].numpy()
    rng = random.Random(seed)
    m = backend.matcher(compiled)
    times = []
    for _ in range(steps):
        t0 = time.thread_time_ns()
        m.fill_bitmask(bitmask, 0)
        times.append((time.thread_time_ns() - t0) / 1e3)
        token = random_allowed_token(row, rng)
        if token is None or token in backend.eos_token_ids or not m.accept_token(token) or m.is_terminated():
            m = backend.matcher(compiled)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar"])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--corpus-schemas", type=int, default=500)
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the default model's)")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from gramserve.model.loader import default_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    backends = {n: create_backend(n, tok, len(tok), [tok.eos_token_id], GrammarOptions()) for n in args.backends}
    print(f"Machine: {json.dumps(machine_info())}\nCommand: `python {' '.join(sys.argv)}`\n")
    print("| grammar | " + " | ".join(f"{n} compile ms / fill us p50 / p99 / max" for n in args.backends) + " |")
    print("|---|" + "---|" * len(args.backends))
    for path in sorted(SUITE.glob("*.json")):
        d = json.loads(path.read_text())
        cells = []
        for name, b in backends.items():
            g = GrammarRequest(kind=d["kind"], text=grammar_text(d), backend=name)
            t0 = time.perf_counter()
            try:
                compiled = compile_grammar(b, g)
            except GrammarCompileError as exc:
                cells.append(f"refused ({str(exc)[:40]})")
                continue
            ms = (time.perf_counter() - t0) * 1e3
            walk_fill_us(b, compiled, args.steps)
            us = walk_fill_us(b, compiled, args.steps)
            cells.append(f"{ms:.1f} / {pct(us, 50):.0f} / {pct(us, 99):.0f} / {max(us):.0f}")
        print(f"| {path.stem} | " + " | ".join(cells) + " |", flush=True)

    files = sorted(CORPUS.glob("*.json"))
    every = max(1, len(files) // args.corpus_schemas)
    files = files[::every][: args.corpus_schemas]
    print(f"\nCompile over {len(files)} corpus schemas (every {every}th file):\n")
    print("| backend | compiled | refused | compile ms p50 / p90 / p99 / max |")
    print("|---|---:|---:|---|")
    for name, b in backends.items():
        times, refused = [], 0
        for f in files:
            g = GrammarRequest(kind="json_schema", text=json.dumps(json.loads(f.read_text())["schema"]), backend=name)
            t0 = time.perf_counter()
            try:
                compile_grammar(b, g)
            except GrammarCompileError:
                refused += 1
                continue
            times.append((time.perf_counter() - t0) * 1e3)
        print(
            f"| {name} | {len(times)} | {refused} | {pct(times, 50):.2f} / {pct(times, 90):.2f} / "
            f"{pct(times, 99):.1f} / {max(times or [0]):.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
