"""A steady load in process: c requests decode and a new one arrives each time one finishes, as under constant traffic.

Not through HTTP: this isolates the scheduler's choice between prefill and decode steps. The suite of
bench_schema_suite.py sends 2c requests, so only about half of them arrive one by one; here every request after the
first c does. For each ``--max-prefill-wait-steps`` value given (the scheduler's setting, changed between runs on
one engine) it reports output tok/s, steps per second, how many steps were prefill steps, and the mean time from a
request's arrival to its first token, over the last three quarters of ``--steps`` steps. ``--profile`` prints where
the host time of steps with prompts waiting (prefill steps) and of the others goes (cProfile).

Prompts are 100 random tokens from a pool that is prefilled once first (so, as in the suite, they are in the prefix
cache), or with ``--uncached`` a new one each time (100 tokens to prefill per request); outputs are 60-100 tokens,
greedy, ``ignore_eos``. ``--eager-prefill-too`` runs each setting a second time with the prefill steps' CUDA graphs
off (`model/prefill_graphs.py`), on the same engine. Example (GPU host, dummy weights)::

    python benchmarks/bench_steady_arrivals.py --model-path llama-3.2-1b.json --tokenizer TOK --waits 0 4 8
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
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
        self.pool = [self.prompt() for _ in range(prompts)]
        self.arrived: dict[str, float] = {}
        self.uncached = False  # a new prompt for every request

    def prompt(self) -> list[int]:
        return [self.rng.randrange(1000, 30000) for _ in range(100)]

    def add(self, k: int, max_new: int | None = None) -> None:
        for _ in range(k):
            rid, params = (
                f"r{self.n}",
                SamplingParams(max_new_tokens=max_new or self.rng.randint(60, 100), temperature=0, ignore_eos=True),
            )
            prompt = self.prompt() if self.uncached else self.pool[self.n % len(self.pool)]
            self.sched.add_request(TokenizedGenerateReq(rid, prompt, params))
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
    p.add_argument("--uncached", action="store_true", help="a new 100-token prompt for every request")
    p.add_argument("--eager-prefill-too", action="store_true", help="each setting again without prefill graphs")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=None, help="default: the device's")
    a = p.parse_args()
    args = ServerArgs(model_path=a.model_path, load_format="dummy", tokenizer_path=a.tokenizer)
    if a.prefill_graph_max_tokens is not None:
        args = dataclasses.replace(args, prefill_graph_max_tokens=a.prefill_graph_max_tokens)
    sched = Scheduler(in_process_config(args), AutoTokenizer.from_pretrained(a.tokenizer))
    load = Load(sched, prompts=3000)
    load.add(len(load.pool), max_new=1)  # every prompt into the prefix cache
    drain(sched)
    load.uncached = a.uncached
    graphs = sched.runner.prefill_graphs
    for wait in a.waits:
        for pieces in (graphs, None) if a.eager_prefill_too else (graphs,):
            sched.max_prefill_wait_steps = wait
            sched.runner.prefill_graphs = pieces
            profiles = None
            if a.profile:
                profiles = {"prompts waiting": cProfile.Profile(), "none waiting": cProfile.Profile()}
            label = f"c={a.concurrency} wait {wait}, prefill {'graphs' if pieces is not None else 'eager'}"
            print(f"{label}: {run(load, a.concurrency, a.steps, profiles)}", flush=True)
            for name, prof in (profiles or {}).items():
                print(f"===== steps with {name}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    sched.runner.prefill_graphs = graphs


if __name__ == "__main__":
    main()
