"""One step's accept + fill for B constrained rows: one process on N xgrammar threads vs K processes.

Why `--grammar-shards` exists (docs/benchmarks.md, "Run 6"). No model: B xgrammar matchers over the GPU
bench's schema (``bench_gpu.SCHEMA``) each take a random allowed token per step, as rows do under dummy
weights (so most of them sit inside JSON strings). Modes:

* ``single tN``: one process, ``accept_token`` per row, then one ``BatchGrammarMatcher(N)`` fill (the
  grammar worker's path with one shard);
* ``procs K``: K worker processes, each owning B/K rows, accepting with ``batch_accept_token`` and filling
  on one thread into one shared bitmask; the steps are driven through shared-memory words that both sides
  poll without sleeping, as the token feed does. The time is from the step's start until every worker is
  done, with the workers' own token picking outside it.

Reported: median ms per step over ``--steps`` after ``--warmup``. Example::

    python benchmarks/bench_fill_shards.py --rows 32 256 --threads 1 4 8 --procs 1 2 4 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

CONTROL_WORDS = 64  # int64: [0] step to run, [1] stop, [8 + k] step worker k finished, [32 + k] step it is ready after


def make_backend(tokenizer_dir: str | None):
    import torch
    from bench_gpu import SCHEMA
    from transformers import AutoTokenizer

    from gramserve.grammar.backends.base import GrammarOptions, GrammarSpec
    from gramserve.grammar.backends.xgrammar_backend import XGrammarBackend
    from gramserve.model.loader import default_tokenizer_dir

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or default_tokenizer_dir())
    backend = XGrammarBackend(tok, len(tok), [tok.eos_token_id], GrammarOptions(max_whitespace=2, strict_json=True))
    return backend, backend.compile(GrammarSpec("json_schema", SCHEMA))


class Lanes:
    """Matchers that each take a random allowed token per step (restarting once their document is done)."""

    def __init__(self, backend, compiled, n: int, seed: int):
        self.backend, self.compiled = backend, compiled
        self.rng = np.random.default_rng(seed)
        self.matchers = [backend.matcher(compiled) for _ in range(n)]

    def pick(self, rows: np.ndarray) -> list[int]:
        bits = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")
        eos = self.backend.eos_token_ids[0]
        tokens = []
        for i in range(len(self.matchers)):
            allowed = np.flatnonzero(bits[i])
            if len(allowed) > 1:
                allowed = allowed[allowed != eos]
            tokens.append(int(self.rng.choice(allowed)))
        return tokens

    def restart_finished(self) -> None:
        for i, m in enumerate(self.matchers):
            if m._m.is_terminated() or m._m.is_completed():
                self.matchers[i] = self.backend.matcher(self.compiled)


def run_single(backend, compiled, rows: int, threads: int, steps: int, warmup: int) -> float:
    import torch
    import xgrammar as xgr

    words = -(-backend.vocab_size // 32)
    bitmask = torch.zeros((rows, words), dtype=torch.int32)
    lanes = Lanes(backend, compiled, rows, seed=0)
    batch = xgr.BatchGrammarMatcher(threads)
    indices = list(range(rows))
    batch.batch_fill_next_token_bitmask([m._m for m in lanes.matchers], bitmask, indices)
    times = []
    for _ in range(steps + warmup):
        tokens = lanes.pick(bitmask.numpy())
        t0 = time.perf_counter()
        for m, t in zip(lanes.matchers, tokens):
            m.accept_token(t)
        batch.batch_fill_next_token_bitmask([m._m for m in lanes.matchers], bitmask, indices)
        times.append(time.perf_counter() - t0)
        lanes.restart_finished()
    return statistics.median(times[warmup:]) * 1e3


def worker(k: int, procs: int, rows: int, shm_name: str, words: int, tokenizer_dir: str | None) -> None:
    import torch
    import xgrammar as xgr

    backend, compiled = make_backend(tokenizer_dir)
    lo, hi = rows * k // procs, rows * (k + 1) // procs
    shm = shared_memory.SharedMemory(name=shm_name)
    control = np.ndarray((CONTROL_WORDS,), dtype=np.int64, buffer=shm.buf)
    bitmask = np.ndarray((rows, words), dtype=np.int32, buffer=shm.buf, offset=CONTROL_WORDS * 8)
    lanes = Lanes(backend, compiled, hi - lo, seed=k)
    batch = xgr.BatchGrammarMatcher(1)
    indices = list(range(lo, hi))
    bitmask_t = torch.from_numpy(bitmask)
    batch.batch_fill_next_token_bitmask([m._m for m in lanes.matchers], bitmask_t, indices)
    tokens = lanes.pick(bitmask[lo:hi])
    control[8 + k] = control[32 + k] = 0
    step = 0
    while True:
        step += 1
        while control[0] < step:
            if control[1]:
                return
        xgr.BatchGrammarMatcher.batch_accept_token([m._m for m in lanes.matchers], tokens)
        batch.batch_fill_next_token_bitmask([m._m for m in lanes.matchers], bitmask_t, indices)
        control[8 + k] = step
        lanes.restart_finished()
        tokens = lanes.pick(bitmask[lo:hi])
        control[32 + k] = step


def run_procs(procs: int, rows: int, words: int, steps: int, warmup: int, tokenizer_dir: str | None) -> float:
    shm = shared_memory.SharedMemory(create=True, size=CONTROL_WORDS * 8 + rows * words * 4)
    control = np.ndarray((CONTROL_WORDS,), dtype=np.int64, buffer=shm.buf)
    control[:] = 0
    control[8 : 8 + procs] = control[32 : 32 + procs] = -1
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(target=worker, args=(k, procs, rows, shm.name, words, tokenizer_dir), daemon=True)
        for k in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        while (control[8 : 8 + procs] < 0).any():
            time.sleep(0.01)
        times = []
        for step in range(1, steps + warmup + 1):
            while (control[32 : 32 + procs] < step - 1).any():  # every worker has picked its tokens
                pass
            t0 = time.perf_counter()
            control[0] = step
            while (control[8 : 8 + procs] < step).any():
                pass
            times.append(time.perf_counter() - t0)
    finally:
        control[1] = 1
        for w in workers:
            w.join(5)
        del control
        shm.close()
        shm.unlink()
    return statistics.median(times[warmup:]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    p.add_argument("--rows", nargs="+", type=int, default=[32, 256])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--procs", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    print(f"{len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()}", flush=True)
    backend, compiled = make_backend(args.tokenizer)
    words = -(-backend.vocab_size // 32)
    for rows in args.rows:
        for threads in args.threads:
            ms = run_single(backend, compiled, rows, threads, args.steps, args.warmup)
            print(f"rows {rows}: one process, {threads} xgrammar threads: {ms:.3f} ms", flush=True)
        for procs in args.procs:
            ms = run_procs(procs, rows, words, args.steps, args.warmup, args.tokenizer)
            print(f"rows {rows}: {procs} processes: {ms:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
