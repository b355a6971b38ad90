"""A steady load in process: c requests decode and a new one arrives each time one finishes, as under constant traffic.

Not through HTTP: this isolates the scheduler's choice between prefill and decode steps. The suite of
bench_schema_suite.py sends 2c requests, so only about half of them arrive one by one; here every request after the
first c does. For each ``--max-prefill-wait-steps`` value given (the scheduler's setting, changed between runs on
one engine) it reports output tok/s, steps per second, how many steps were prefill steps, and the mean time from a
request's arrival to its first token, over the last three quarters of ``--steps`` steps. ``--profile`` prints where
the host time of steps with prompts waiting (prefill steps) and of the others goes (cProfile).

Prompts are 100 random tokens from a pool that is prefilled once first (so, as in the suite, they are in the prefix
cache); outputs are 60-100 tokens, greedy, ``ignore_eos``. Example (GPU host, dummy weights)::

    python benchmarks/bench_steady_arrivals.py --model-path llama-3.2-1b.json --tokenizer TOK --waits 0 4 8
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from transformers import AutoTokenizer

from gramserve.config import ServerArgs
from gramserve.messages import TokenizedGenerateReq
from gramserve.sampling.params import SamplingParams
from gramserve.scheduler.scheduler import Scheduler
from gramserve.server.settings import in_process_config


class Load:
    """Requests from a pool of prompts, each stamped with its arrival time."""

    def __init__(self, sched: Scheduler, prompts: int, seed: int = 0):
        self.sched, self.rng, self.n = sched, random.Random(seed), 0
        self.pool = [[self.rng.randrange(1000, 30000) for _ in range(100)] for _ in range(prompts)]
        self.arrived: dict[str, float] = {}

    def add(self, k: int, max_new: int | None = None) -> None:
        for _ in range(k):
            rid, params = (
                f"r{self.n}",
                SamplingParams(max_new_tokens=max_new or self.rng.randint(60, 100), temperature=0, ignore_eos=True),
            )
            self.sched.add_request(TokenizedGenerateReq(rid, self.pool[self.n % len(self.pool)], params))
            self.arrived[rid] = time.perf_counter()
            self.n += 1

    def live(self) -> int:
        return sum(1 for r in self.sched.running if r.finished is None) + len(self.sched.admission.waiting)


def drain(sched: Scheduler) -> None:
    while sched.has_work:
        sched.step()


def run(load: Load, concurrency: int, steps: int, profiles: dict[str, cProfile.Profile] | None) -> str:
    sched, window = load.sched, steps // 4
    load.arrived.clear()
    load.add(concurrency)
    tokens, ttft, kinds, t_start = 0, [], [], 0.0
    for i in range(steps):
        load.add(max(0, concurrency - load.live()))
        if i == window:
            t_start, tokens, ttft, kinds = time.perf_counter(), 0, [], []
        prof = None
        if profiles is not None and i >= window:
            prof = profiles["prompts waiting" if sched.admission.waiting else "none waiting"]
            prof.enable()
        out = sched.step()
        if prof is not None:
            prof.disable()
        kinds.append("P" if sched._last_was_prefill else "D")
        now = time.perf_counter()
        for rid, ids in zip(out.rids, out.new_token_ids) if out else ():
            tokens += len(ids)
            arrived = load.arrived.pop(rid, None)
            if arrived is not None and i >= window and arrived >= t_start:
                ttft.append(now - arrived)
    wall = time.perf_counter() - t_start
    sched.abort_all("end of run")
    drain(sched)
    return (
        f"{tokens / wall:,.0f} tok/s, {len(kinds) / wall:.0f} steps/s, prefill steps {kinds.count('P')} of "
        f"{len(kinds)}, mean TTFT {1e3 * sum(ttft) / max(1, len(ttft)):.1f} ms ({len(ttft)} requests)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--waits", type=int, nargs="+", default=[0, 4, 8])
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    sched = Scheduler(
        in_process_config(ServerArgs(model_path=a.model_path, load_format="dummy", tokenizer_path=a.tokenizer)),
        AutoTokenizer.from_pretrained(a.tokenizer),
    )
    load = Load(sched, prompts=3000)
    load.add(len(load.pool), max_new=1)  # every prompt into the prefix cache
    drain(sched)
    for wait in a.waits:
        sched.max_prefill_wait_steps = wait
        profiles = {"prompts waiting": cProfile.Profile(), "none waiting": cProfile.Profile()} if a.profile else None
        print(f"c={a.concurrency} wait {wait}: {run(load, a.concurrency, a.steps, profiles)}", flush=True)
        for name, prof in (profiles or {}).items():
            print(f"===== steps with {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
