"""Per-step mask filling: row by row vs batched on N threads (gramserve.grammar.fill), per backend and batch size.

No model, only the default tokenizer. A batch of B constrained "requests" is B matchers over real schemas
of ``../shared/corpora/jsonschemabench-dev`` (round robin over ``--schemas`` schemas), each walking a valid
instance from a different depth; a matcher that reaches the end of its instance starts over. Every step
fills all B rows once per mode (``serial`` = ``Matcher.fill_bitmask`` row by row, the path before batching;
``tN`` = ``fill_rows`` with a ``FillPool`` of N threads), the modes in rotating order, then advances each
matcher by one token (the accept loop of ``GrammarService.step`` is timed too). Reported: median ms per step
over ``--steps`` steps after ``--warmup``, and the speed-up over ``serial``.

``--suite NAME ...`` takes grammars of ``benchmarks/speed_suite`` instead (all of them: ``--suite all``), and
every row walks at random instead of along an instance: each step it takes a token the mask allows, at random,
as a random-weight model at temperature 1.0 does, so that rows spend their time where masks are dear (inside
bounded strings) and not only on the path of one valid instance. The backend compiles each grammar once per
thread of the largest pool (``GrammarBackend.fill_lanes``), as the grammar service does.

Example::

    python benchmarks/bench_mask_fill.py --batch-sizes 1 16 64 256 --threads 1 2
    python benchmarks/bench_mask_fill.py --backends llguidance --suite extraction_record easy_four_fields \
        --batch-sizes 16 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CORPUS = REPO / ".." / "shared" / "corpora" / "jsonschemabench-dev"


SUITE = REPO / "benchmarks" / "speed_suite"
MAX_WALK = 400  # a random walk starts over after this many tokens


@dataclass
class Case:
    compiled: object
    tokens: list[int]  # a valid instance to walk along; empty: walk at random


@dataclass
class Lane:
    """One running request: a matcher per mode (all in the same state: llguidance keeps the last mask it computed,
    so modes must not share matchers) and where it is in its instance."""

    case: Case
    matchers: list
    pos: int = 0


@dataclass
class Result:
    backend: str
    batch: int
    accept_ms: float
    fill_ms: dict[str, float] = field(default_factory=dict)  # mode -> median ms per step
    # mode -> mean ms per step: a step waits for its dearest rows, and rare dear steps (xgrammar's bounded strings)
    # leave the median alone
    mean_ms: dict[str, float] = field(default_factory=dict)


def load_cases(backend, tokenizer, corpus: Path, count: int, max_bytes: int) -> list[Case]:
    from gramserve.grammar.backends import GrammarCompileError, GrammarSpec
    from tests.grammar_eval import small_cases

    cases = []
    for _, text, valid in small_cases(corpus, 20, max_bytes):
        try:
            compiled = backend.compile(GrammarSpec("json_schema", text))
        except GrammarCompileError:
            continue
        backend.add_lanes(compiled)
        tokens = tokenizer.encode(json.dumps(valid[0]), add_special_tokens=False)
        probe = backend.matcher(compiled)
        if len(tokens) >= 8 and all(probe.accept_token(t) for t in tokens):
            cases.append(Case(compiled, tokens))
        if len(cases) == count:
            break
    return cases


def load_suite(backend, names: list[str]) -> list[Case]:
    from gramserve.grammar.backends import GrammarSpec

    paths = sorted(SUITE.glob("*.json")) if names == ["all"] else [SUITE / f"{n}.json" for n in names]
    cases = []
    for path in paths:
        spec = json.loads(path.read_text())
        text = spec["grammar"] if isinstance(spec["grammar"], str) else json.dumps(spec["grammar"])
        compiled = backend.compile(GrammarSpec(spec["kind"], text))
        backend.add_lanes(compiled)  # as the grammar service does after the first answer
        cases.append(Case(compiled, []))
    return cases


def random_allowed(bitmask_row, vocab: int, rng: random.Random) -> int:
    import numpy as np

    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    allowed = np.flatnonzero(bits)
    return int(allowed[rng.randrange(len(allowed))])


def matcher_on_lane(backend, compiled, lane: int):
    """A matcher copied from fill lane `lane` of the grammar (llguidance hands lanes out in turn; others have one)."""
    for _ in range(backend.fill_lanes):
        m = backend.matcher(compiled)
        if getattr(m, "lane", lane) == lane:
            return m
    raise AssertionError(f"no matcher on lane {lane}")


def new_lane(backend, case: Case, depth: int, modes: int, row: int) -> Lane:
    """Row `row`'s matchers, all on the same fill lane (row mod lanes), so that every mode spreads its rows
    over the lanes alike."""
    lane = Lane(case, [matcher_on_lane(backend, case.compiled, row % backend.fill_lanes) for _ in range(modes)])
    for t in case.tokens[:depth]:
        for m in lane.matchers:
            m.accept_token(t)
    lane.pos = depth
    return lane


def run_batch(backend, cases: list[Case], batch: int, modes: dict, steps: int, warmup: int, seed: int) -> Result:
    import torch

    from gramserve.grammar.fill import fill_rows
    from gramserve.sampling.bitmask import allocate_bitmask

    rng = random.Random(seed)
    lanes = [
        new_lane(backend, cases[i % len(cases)], rng.randrange(len(cases[i % len(cases)].tokens) or 1), len(modes), i)
        for i in range(batch)
    ]
    bitmask = allocate_bitmask(batch, backend.vocab_size)
    times: dict[str, list[float]] = {name: [] for name in modes}
    accepts: list[float] = []
    names = list(modes)
    for step in range(warmup + steps):
        first = None
        for k in range(len(names)):
            name = names[(step + k) % len(names)]
            pool = modes[name]
            items = [(lane.matchers[names.index(name)], row) for row, lane in enumerate(lanes)]
            t0 = time.perf_counter()
            if pool is None:
                for m, row in items:
                    m.fill_bitmask(bitmask, row)
            else:
                fill_rows(items, bitmask, pool)
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
            if first is None:
                first = bitmask.clone()
            elif not torch.equal(bitmask, first):
                raise AssertionError(f"{name} and {names[step % len(names)]} wrote other masks at step {step}")
        picks = [
            lane.case.tokens[lane.pos] if lane.case.tokens else random_allowed(bitmask[row], backend.vocab_size, rng)
            for row, lane in enumerate(lanes)
        ]
        t0 = time.perf_counter()
        for lane, token in zip(lanes, picks):
            if lane.pos < len(lane.case.tokens) or not lane.case.tokens:
                lane.matchers[0].accept_token(token)
                lane.pos += 1
        if step >= warmup:
            accepts.append(time.perf_counter() - t0)  # one matcher per row, as a grammar worker accepts
        for lane, token in zip(lanes, picks):
            for m in lane.matchers[1:]:
                m.accept_token(token)
        for i, lane in enumerate(lanes):
            walked = lane.matchers[0].is_terminated() or lane.pos >= MAX_WALK
            if lane.pos >= len(lane.case.tokens) if lane.case.tokens else walked:
                lanes[i] = new_lane(backend, lane.case, 0, len(modes), i)
    res = Result(backend.name, batch, statistics.median(accepts) * 1e3)
    res.fill_ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    res.mean_ms = {name: statistics.fmean(ts) * 1e3 for name, ts in times.items()}
    return res


def print_table(results: list[Result], modes: list[str]) -> None:
    head = ["backend", "batch", "accept ms"] + [f"{m} ms" for m in modes] + [f"{m} x" for m in modes if m != "serial"]
    rows = [head]
    for r in results:
        serial = r.fill_ms["serial"]
        rows.append(
            [r.backend, str(r.batch), f"{r.accept_ms:.3f}"]
            + [f"{r.fill_ms[m]:.3f}" for m in modes]
            + [f"{serial / r.fill_ms[m]:.2f}" for m in modes if m != "serial"]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    p.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance", "outlines"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="FillPool sizes to compare with serial")
    p.add_argument(
        "--min-batch-rows",
        type=int,
        default=None,
        help="FillPool.min_batch_rows (default: the server's); 1 batches even a single row",
    )
    p.add_argument(
        "--parallel-rows",
        type=int,
        default=None,
        help="FillPool.parallel_rows (default: the server's): smaller batches run on one thread",
    )
    p.add_argument("--schemas", type=int, default=24, help="distinct corpus schemas per backend")
    p.add_argument("--lanes", type=int, default=None, help="fill lanes per grammar (default: the most threads)")
    p.add_argument("--suite", nargs="+", default=None, help="speed-suite grammars (or 'all'), walked at random")
    p.add_argument("--max-schema-bytes", type=int, default=4000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from gramserve.grammar.backends import GrammarOptions, create_backend
    from gramserve.grammar.fill import FillPool, available_cores
    from gramserve.model.loader import default_tokenizer_dir

    torch.set_num_threads(1)  # as in the grammar worker
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    modes: dict[str, FillPool | None] = {"serial": None}
    for n in args.threads:
        pool = FillPool(threads=n)
        if args.min_batch_rows is not None:
            pool.min_batch_rows = args.min_batch_rows
        if args.parallel_rows is not None:
            pool.parallel_rows = args.parallel_rows
        modes[f"t{n}"] = pool
    print(
        f"{platform.processor() or platform.machine()}, {available_cores()} cores available, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; vocab {len(tokenizer)}; "
        f"FillPool {next((m for m in modes.values() if m), None)}",
        flush=True,
    )
    results = []
    for name in args.backends:
        backend = create_backend(
            name,
            tokenizer,
            len(tokenizer),
            [tokenizer.eos_token_id],
            GrammarOptions(max_whitespace=2, strict_json=True),
        )
        backend.fill_lanes = args.lanes or max(args.threads)
        t0 = time.monotonic()
        if args.suite:
            cases = load_suite(backend, args.suite)
        else:
            cases = load_cases(backend, tokenizer, args.corpus, args.schemas, args.max_schema_bytes)
        print(f"{name}: {len(cases)} grammars compiled in {time.monotonic() - t0:.1f} s", flush=True)
        for batch in args.batch_sizes:
            results.append(run_batch(backend, cases, batch, modes, args.steps, args.warmup, seed=batch))
            print(
                f"  batch {batch}: "
                + ", ".join(
                    f"{k} {v:.3f} ms (mean {results[-1].mean_ms[k]:.3f})" for k, v in results[-1].fill_ms.items()
                ),
                flush=True,
            )
    print()
    print_table(results, list(modes))
    if args.output_json:
        args.output_json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
