"""GPU benchmark of gramserve in one run, with a short table printed last.

Drives the engine in-process (Scheduler + ModelRunner, no HTTP server and no detokenizer; grammar masks come
from the server's own grammar workers, with the token feed as in serving), on dummy bf16 weights in
the shapes of Llama-3.1-8B and Llama-3.2-1B:

1. decode at batch 1: time per output token (median scheduler step) vs the roofline, i.e. the bytes of
   weights read per token / the device-to-device copy bandwidth measured in the same run;
2. throughput: N requests (default 1,000) with ShareGPT-like random lengths, all submitted at once: output tok/s
   (`--workload serving`: instead the very requests bench_serving.py's random dataset sends for the same seed and
   lengths, so an HTTP burst has its in-process twin);
3. HF transformers on a subset of the same prompts (batched `generate`, and `generate_batch` where it exists)
   and gramserve on the same subset: the ratio;
4. JSON-schema-constrained vs unconstrained decode tok/s at batch 1, 32 and 256 (bitmask applied on the GPU;
   `--no-feed-models` repeats it without the token feed, rows '<model> no-feed');
5. attention micro-benchmarks per backend (decode and prefill) with achieved bandwidth / FLOP rate.

    python benchmarks/bench_gpu.py --assets .gpu --out bench_gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gramserve.config import LaunchInfo, ServerArgs, ServerConfig  # noqa: E402
from gramserve.messages import GrammarRequest, TokenizedGenerateReq  # noqa: E402
from gramserve.sampling.params import SamplingParams  # noqa: E402

log = logging.getLogger("bench_gpu")
DEVICE = "cuda"  # "cpu" only for a smoke run of the script itself (--device cpu)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


RESULTS: dict = {}
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "summary": {"type": "string"},
        },
        "required": ["title", "year", "tags", "summary"],
    }
)


def save(path: str) -> None:
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(name: str):
    """Run a benchmark section; an exception is logged and recorded, the run goes on."""

    def wrap(fn):
        def run(*a, **kw):
            t0 = time.time()
            try:
                return fn(*a, **kw)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                RESULTS.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
            finally:
                log.info("section %s took %.1f s", name, time.time() - t0)

        return run

    return wrap


# --- measurement helpers ---------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def workload(n: int, seed: int, vocab: int, in_mean=200, out_mean=180) -> list[tuple[list[int], int]]:
    """ShareGPT-like: log-normal lengths (sigma 0.9) with the given means, clipped to [4, 1024] / [4, 512]."""
    rng = random.Random(seed)
    sigma = 0.9

    def draw(mean, hi):
        return int(min(hi, max(4, rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))

    out = []
    for _ in range(n):
        n_in, n_out = draw(in_mean, 1024), draw(out_mean, 512)
        out.append(([rng.randrange(100, vocab) for _ in range(n_in)], n_out))
    return out


def serving_workload(n: int, seed: int, input_len: int, output_len: int, range_ratio: float):
    """bench_serving.py's random requests for the same arguments (its default vocabulary range)."""
    from bench_serving import sample_requests

    reqs = sample_requests(n, input_len, output_len, range_ratio, 100, 40000, random.Random(seed))
    return [(r.prompt_ids, r.output_len) for r in reqs]


class Engine:
    """A Scheduler in this process, driven step by step."""

    def __init__(
        self,
        model_json: str,
        tokenizer_dir: str,
        grammar: bool,
        token_feed: bool = True,
        busy_poll: bool = True,
        **overrides,
    ):
        from transformers import AutoTokenizer

        from gramserve.scheduler.scheduler import Scheduler
        from gramserve.server.settings import resolve_settings

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        cfg = json.load(open(model_json))
        args = ServerArgs(
            model_path=model_json,
            load_format="dummy",
            tokenizer_path=tokenizer_dir,
            context_length=4096,
            device=DEVICE,
            grammar_backend="xgrammar",
            **overrides,
        )
        settings = resolve_settings(args)
        launch = LaunchInfo(tokenizer_dir=tokenizer_dir, vocab_size=cfg["vocab_size"])
        if grammar:
            eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
            eos = sorted(set(eos) | {self.tokenizer.eos_token_id})
            # Masks over the tokenizer's vocabulary: the dummy models' logits are wider (128,256 columns vs
            # 49,152 tokens) and the columns past the bitmask are disallowed when it is applied. Padding the
            # grammar's vocabulary with ~79k empty tokens makes xgrammar's fills ~5x slower.
            gvocab = len(self.tokenizer)
            launch = LaunchInfo(
                tokenizer_dir=tokenizer_dir, vocab_size=gvocab, eos_token_ids=tuple(t for t in eos if t < gvocab)
            )
        self.config = ServerConfig(args, settings, launch)
        client = self._grammar_workers() if grammar else None
        t0 = time.time()
        self.sched = Scheduler(self.config, self.tokenizer, client)
        if client is not None and not token_feed:
            client.stop_feed()
        if client is not None and not busy_poll:
            client.busy_poll = False  # both sides of the grammar hand-off block (and sleep-poll the feed)
        torch.set_num_threads(settings.scheduler_threads)  # as the server's scheduler process does
        self.start_seconds = time.time() - t0
        self.info = self.sched.runner.info
        self.vocab = len(self.tokenizer)
        self._rid = 0
        self.warm_up()

    def warm_up(self) -> None:
        """A few short requests of several prompt lengths, so JIT-compiled kernels (FlashInfer's prefill on a
        new head shape) are built before anything is timed."""
        for n in (16, 300, 1500):
            self.add(list(range(100, 100 + n)), 4)
        self.run()

    def _grammar_workers(self):
        """The server's own grammar workers and GrammarClient (ZeroMQ + shared-memory bitmask and token
        feed)."""
        import dataclasses
        import multiprocessing as mp
        import tempfile

        import zmq

        from gramserve.grammar.grammar_shm import create_grammar_shm
        from gramserve.grammar.worker import run_grammar_worker
        from gramserve.scheduler.grammar_client import GrammarClient

        class TimedGrammarClient(GrammarClient):
            fill_ms: dict[int, float] = {}  # step -> the slowest shard's accept + fill time

            def _on_step(self, resp):
                super()._on_step(resp)
                if resp.fill_ms:
                    self.fill_ms[resp.step] = max(self.fill_ms.get(resp.step, 0.0), resp.fill_ms)

        config = self.config
        self._shm = create_grammar_shm(config.settings.max_running_requests, config.launch.vocab_size)
        launch = dataclasses.replace(
            config.launch, ipc_dir=tempfile.mkdtemp(prefix="gramserve-bench-"), grammar_shm=self._shm.name
        )
        config = self.config = dataclasses.replace(config, launch=launch)
        ctx = mp.get_context("spawn")
        self._gprocs = []
        for shard in range(config.settings.grammar_shards):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_grammar_worker, args=(config, writer, shard), daemon=True)
            proc.start()
            self._gprocs.append((proc, reader))
        for proc, reader in self._gprocs:
            if not reader.poll(180):
                raise RuntimeError("grammar worker did not start")
            msg = reader.recv()
            if "error" in msg:
                raise RuntimeError(msg["error"])
        return TimedGrammarClient(config, zmq.Context())

    def add(self, prompt: list[int], max_new: int, grammar: bool = False, **sampling) -> None:
        """One request, greedy unless `sampling` sets other SamplingParams (temperature, top_p, ...)."""
        self._rid += 1
        sampling.setdefault("temperature", 0.0)
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=not grammar, **sampling)
        g = GrammarRequest("json_schema", SCHEMA, backend="xgrammar") if grammar else None
        self.sched.add_request(TokenizedGenerateReq(f"r{self._rid}", prompt, params, grammar=g))

    def busy(self) -> bool:
        return self.sched.has_work or bool(self.sched.grammar_wait)

    def run(self) -> dict:
        """Step until idle. Returns wall time, output tokens and per-step (kind, batch, seconds)."""
        steps, out_tokens = [], 0
        sync()
        t0 = time.perf_counter()
        while self.busy():
            self.sched.poll_grammar()
            ts = time.perf_counter()
            out = self.sched.step()
            dt = time.perf_counter() - ts
            if out is not None:
                n = sum(len(t) for t in out.new_token_ids)
                out_tokens += n
                steps.append(("prefill" if self.sched._last_was_prefill else "decode", len(out.rids), n, dt))
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "output_tokens": out_tokens, "steps": steps}

    def close(self) -> None:
        if self.sched.grammar is not None:
            self.sched.grammar.close()
        for proc, _ in getattr(self, "_gprocs", []):
            proc.terminate()
            proc.join(5)
        del self.sched
        gc.collect()
        if getattr(self, "_shm", None) is not None:
            self._shm.close()
            self._shm.unlink()
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def phases_per_step(before: dict, after: dict) -> dict:
    """Mean host ms per scheduler step spent in each phase (Scheduler.phases) between two snapshots."""
    steps = max(1, after["steps"] - before["steps"])
    return {k: round((after[k] - before[k]) / steps, 3) for k in after if k != "steps"}


def step_histogram(steps) -> dict:
    """Decode steps bucketed by batch size: count, mean ms, share of the decode time."""
    edges = [1, 8, 32, 64, 128, 256, 512, 768, 1024, 10**9]
    total = sum(s[3] for s in steps) or 1.0
    out = {}
    for lo, hi in zip(edges, edges[1:]):
        sel = [s[3] for s in steps if lo <= s[1] < hi]
        if sel:
            out[f"{lo}-{hi - 1}"] = {
                "steps": len(sel),
                "mean_ms": 1e3 * statistics.mean(sel),
                "share": sum(sel) / total,
            }
    return out


def weight_bytes_per_token(runner) -> int:
    """Bytes of weights a decode step reads: every parameter except an untied input embedding (one row)."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


# --- sections ------------------------------------------------------------------------------------------


@section("decode_b1")
def bench_decode_b1(eng: Engine, name: str, bw: float) -> None:
    rng = random.Random(0)
    eng.add([rng.randrange(100, eng.vocab) for _ in range(128)], 256)  # warm-up request
    eng.run()
    eng.add([rng.randrange(100, eng.vocab) for _ in range(128)], 256)
    res = eng.run()
    dec = [s[3] for s in res["steps"] if s[0] == "decode"]
    per_tok = statistics.median(dec)
    wbytes = weight_bytes_per_token(eng.sched.runner)
    roof = wbytes / bw
    graph_ms = None
    gr = eng.sched.runner.graph_runner
    if gr is not None:  # the GPU time alone: replays of the batch-1 graph back to back
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            gr.graphs[1].replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        graph_ms = statistics.median(times)
        replay = {}
        for bs in (64, 256, 512):  # GPU time of larger decode batches (KV of one slot each: weights-bound)
            if bs in gr.graphs:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                gr.graphs[bs].replay()
                a.record()
                for _ in range(10):
                    gr.graphs[bs].replay()
                b.record()
                b.synchronize()
                replay[bs] = a.elapsed_time(b) / 10
        RESULTS.setdefault("graph_replay_ms", {})[name] = replay
    RESULTS.setdefault("decode_b1", {})[name] = {
        "graph_replay_ms": graph_ms,
        "ms_per_token_median": per_tok * 1e3,
        "ms_per_token_mean": statistics.mean(dec) * 1e3,
        "weight_gb_per_token": wbytes / 1e9,
        "roofline_ms": roof * 1e3,
        "ratio_to_roofline": per_tok / roof,
        "cuda_graphs": eng.info.cuda_graph_max_bs > 0,
    }
    log.info(
        "%s decode b1: %.2f ms/token (graph replay alone %s ms), roofline %.2f ms (%.2fx)",
        name,
        per_tok * 1e3,
        graph_ms,
        roof * 1e3,
        per_tok / roof,
    )


@section("throughput")
def bench_throughput(eng: Engine, name: str, reqs) -> None:
    for prompt, n_out in reqs:
        eng.add(prompt, n_out)
    before = eng.sched.phases.snapshot()
    res = eng.run()
    phases = phases_per_step(before, eng.sched.phases.snapshot())
    pre = sum(s[3] for s in res["steps"] if s[0] == "prefill")
    dec = [s for s in res["steps"] if s[0] == "decode"]
    RESULTS.setdefault("throughput", {})[name] = {
        "requests": len(reqs),
        "input_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": res["output_tokens"],
        "wall_s": res["wall_s"],
        "output_tok_s": res["output_tokens"] / res["wall_s"],
        "total_tok_s": (res["output_tokens"] + sum(len(p) for p, _ in reqs)) / res["wall_s"],
        "prefill_s": pre,
        "decode_s": sum(s[3] for s in dec),
        "decode_steps": len(dec),
        "mean_decode_batch": statistics.mean(s[1] for s in dec) if dec else 0,
        "decode_by_batch": step_histogram(dec),
        "retractions": eng.sched.stats["retractions"],
        "phases_ms_per_step": phases,
    }
    log.info("%s throughput: %s", name, RESULTS["throughput"][name])


@section("gramserve_hf_subset")
def bench_subset(eng: Engine, name: str, subset, n_out: int) -> None:
    for prompt, _ in subset:
        eng.add(prompt, n_out)
    res = eng.run()
    RESULTS.setdefault("hf_compare", {}).setdefault(name, {})["gramserve_subset_tok_s"] = (
        res["output_tokens"] / res["wall_s"]
    )


def _grammar_pass(
    eng: Engine, name: str, bs: int, constrained: bool, n_out: int, rng: random.Random, profile: str = ""
) -> dict:
    """One batch of `bs` requests (JSON-schema-constrained or not), decoded together: tok/s over its full-batch
    decode steps, the scheduler's host phases and, constrained, the grammar hand-off times."""
    kind = "constrained" if constrained else "unconstrained"
    prompts = [[rng.randrange(100, eng.vocab) for _ in range(64)] for _ in range(bs)]
    eng.sched.grammar.fill_ms.clear()
    for p in prompts:
        eng.add(p, n_out, grammar=constrained)
    before = eng.sched.phases.snapshot()
    timing_before = dict(eng.sched.grammar.timing)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    res = eng.run()
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        with open(profile, "a") as f:
            f.write(f"== {name} batch {bs} {kind}\n{text.getvalue()}\n")
    full = [s for s in res["steps"] if s[0] == "decode" and s[1] == bs]
    use = full if len(full) >= 8 else [s for s in res["steps"] if s[0] == "decode"]
    out = {
        "tok_s": sum(s[2] for s in use) / sum(s[3] for s in use),
        "steps": len(use),
        "step_ms": 1e3 * sum(s[3] for s in use) / max(1, len(use)),
        "phases_ms_per_step": phases_per_step(before, eng.sched.phases.snapshot()),
    }
    if constrained:
        timing = dict(eng.sched.grammar.timing)
        out["grammar_client_ms_per_step"] = {
            k: round((timing[k] - timing_before[k]) / max(1, timing["steps"] - timing_before["steps"]), 3)
            for k in ("wait_after_forward_ms", "apply_ms", "fill_ms")
        }
        out["fed_steps"] = timing["fed_steps"] - timing_before["fed_steps"]
        if eng.sched.grammar.fill_ms:
            out["mask_fill_ms_median"] = statistics.median(eng.sched.grammar.fill_ms.values())
    return out


@section("grammar")
def bench_grammar(
    eng: Engine, name: str, batch_sizes=(1, 32, 256), n_out: int = 96, repeats: int = 5, profile: str = ""
) -> None:
    """Constrained vs unconstrained tok/s per batch size: `repeats` pairs of passes, unconstrained then
    constrained, back to back; the ratio reported is the median of the pairs' ratios (one pass is 0.1-0.5 s,
    short enough for a hiccup of the host to move it). `profile`: a file; the first pair at the largest batch size
    is profiled (cProfile, by own time) into it."""
    rng = random.Random(3)
    out = {}
    eng.add([rng.randrange(100, eng.vocab) for _ in range(32)], 8, grammar=True)  # compile + warm-up
    eng.run()
    for bs in batch_sizes:
        pairs = []
        for rep in range(repeats):
            prof = profile if profile and rep == 0 and bs == max(batch_sizes) else ""
            u = _grammar_pass(eng, name, bs, False, n_out, rng, prof)
            c = _grammar_pass(eng, name, bs, True, n_out, rng, prof)
            pairs.append((c["tok_s"] / u["tok_s"], u, c))
        pairs.sort(key=lambda p: p[0])
        ratio, u, c = pairs[len(pairs) // 2]  # the median pair (the upper one of an even count)
        row = {
            "ratio": ratio,
            "ratios": [round(p[0], 3) for p in pairs],
            "unconstrained": u["tok_s"],
            "constrained": c["tok_s"],
            "unconstrained_step_ms": u["step_ms"],
            "constrained_step_ms": c["step_ms"],
            "unconstrained_steps": u["steps"],
            "constrained_steps": c["steps"],
            "unconstrained_phases_ms_per_step": u["phases_ms_per_step"],
            "constrained_phases_ms_per_step": c["phases_ms_per_step"],
            **{k: c[k] for k in ("grammar_client_ms_per_step", "fed_steps", "mask_fill_ms_median") if k in c},
        }
        out[bs] = row
        log.info("%s grammar bs=%d: %s", name, bs, row)
    RESULTS.setdefault("grammar", {})[name] = out


@section("hf")
def bench_hf(model_json: str, name: str, subset, n_out: int) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: F401

    cfg = AutoConfig.for_model(**json.load(open(model_json)))
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    res = RESULTS.setdefault("hf_compare", {}).setdefault(name, {})
    res["transformers"] = transformers.__version__
    res["requests"], res["max_new_tokens"] = len(subset), n_out
    prompts = [p for p, _ in subset]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    with torch.no_grad():
        model.generate(
            ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False, pad_token_id=0
        )  # warm-up
        sync()
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0
        )
        sync()
        dt = time.perf_counter() - t0
    gen = (out.shape[1] - width) * len(prompts)
    res["generate_tok_s"] = gen / dt
    log.info("HF generate %s: %d tokens in %.1f s", name, gen, dt)
    if hasattr(model, "generate_batch"):
        try:
            import inspect

            gc_ = GenerationConfig(max_new_tokens=n_out, do_sample=False, eos_token_id=None, pad_token_id=0)
            kw = {}
            if "warmup" in inspect.signature(model.generate_batch).parameters:
                kw["warmup"] = False  # its warm-up (graph capture) runs in an untimed call first
                model.generate_batch(
                    inputs=prompts[:4],
                    generation_config=GenerationConfig(
                        max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
                    ),
                )
            sync()
            t0 = time.perf_counter()
            outs = model.generate_batch(inputs=prompts, generation_config=gc_, **kw)
            sync()
            dt = time.perf_counter() - t0
            gen = sum(len(o.generated_tokens) for o in outs.values())
            res["generate_batch_tok_s"] = gen / dt
            log.info("HF generate_batch %s: %d tokens in %.1f s", name, gen, dt)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["generate_batch_error"] = f"{type(e).__name__}: {e}"
    del model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


@section("attention")
def bench_attention(backends: list[str], hq=32, hkv=8, d=128) -> None:
    from triton.testing import do_bench

    from gramserve.model.attention import create_backend
    from gramserve.model.forward_batch import ForwardBatch, ForwardMode
    from gramserve.model.kv_cache import KVCache

    dev = torch.device("cuda")
    slots = 300_000
    kv = KVCache(1, slots, hkv, d, torch.bfloat16, dev)
    kv.k[0].normal_()
    kv.v[0].normal_()
    table = torch.zeros((256, 8192), dtype=torch.int32, device=dev)
    cases = [
        ("decode", 1, 4096, 0),
        ("decode", 64, 1024, 0),
        ("decode", 256, 1024, 0),
        ("decode", 64, 4096, 0),
        ("prefill", 1, 4096, 0),
        ("prefill", 8, 512, 1536),
        ("prefill", 32, 128, 896),
    ]
    out = {}
    for backend_name in backends:
        backend = create_backend(backend_name, kv, hq)
        for mode, bs, new, prefix in cases:
            if mode == "decode":
                total = new  # KV length; one new token
                new_tok, pre = 1, total - 1
            else:
                total, new_tok, pre = prefix + new, new, prefix
            perm = torch.randperm(slots, device=dev)[: bs * total].int() + 1
            table[:bs, :total] = perm.view(bs, total)
            loc = table[:bs, pre:total].reshape(-1).long()
            t = bs * new_tok
            batch = ForwardBatch(
                ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
                torch.zeros(t, dtype=torch.long, device=dev),
                torch.arange(pre, total, device=dev).repeat(bs),
                loc,
                torch.arange(bs, device=dev),
                torch.full((bs,), total, device=dev),
                [total] * bs,
                [pre] * bs,
                [new_tok] * bs,
                table,
            )
            q = torch.randn(t, hq, d, dtype=torch.bfloat16, device=dev)
            k = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=dev)
            v = torch.randn_like(k)
            backend.init_forward_metadata(batch)
            ms = do_bench(lambda: backend.forward(q, k, v, 0, batch, d**-0.5), warmup=25, rep=100, return_mode="median")
            kv_bytes = bs * total * hkv * d * 2 * 2
            flops = 4 * bs * hq * d * (new_tok * pre + new_tok * (new_tok + 1) / 2)
            key = f"{mode} bs={bs} kv={total}" + (f" new={new_tok}" if mode == "prefill" else "")
            out.setdefault(key, {})[backend_name] = {
                "us": ms * 1e3,
                "kv_gb_s": kv_bytes / ms / 1e6,
                "tflop_s": flops / ms / 1e9,
            }
            log.info("attention %s %s: %.1f us", backend_name, key, ms * 1e3)
    RESULTS["attention"] = out


def table() -> str:
    lines = []
    gpu = RESULTS.get("env", {}).get("gpu")
    bw = RESULTS.get("env", {}).get("copy_bw_tb_s")
    lines.append(f"GPU {gpu}; device-to-device copy {bw:.2f} TB/s" if bw else f"GPU {gpu}")
    lines.append(
        "| model | decode b1 ms/token | b1 graph replay ms | roofline ms | ratio | throughput out tok/s "
        "| HF generate tok/s | HF generate_batch tok/s | gramserve subset tok/s | ratio vs HF generate |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name in RESULTS.get("models", []):
        d = RESULTS.get("decode_b1", {}).get(name, {})
        t = RESULTS.get("throughput", {}).get(name, {})
        h = RESULTS.get("hf_compare", {}).get(name, {})

        def f(x, fmt="{:.0f}"):
            return fmt.format(x) if isinstance(x, (int, float)) else "-"

        ratio = (
            (h["gramserve_subset_tok_s"] / h["generate_tok_s"])
            if "generate_tok_s" in h and "gramserve_subset_tok_s" in h
            else None
        )
        lines.append(
            f"| {name} | {f(d.get('ms_per_token_median'), '{:.2f}')} | {f(d.get('graph_replay_ms'), '{:.2f}')} | "
            f"{f(d.get('roofline_ms'), '{:.2f}')} | "
            f"{f(d.get('ratio_to_roofline'), '{:.2f}x')} | {f(t.get('output_tok_s'))} | "
            f"{f(h.get('generate_tok_s'))} | {f(h.get('generate_batch_tok_s'))} | "
            f"{f(h.get('gramserve_subset_tok_s'))} | {f(ratio, '{:.1f}x')} |"
        )
    g = RESULTS.get("grammar", {})
    if g:
        lines.append("")
        lines.append(
            "| model | batch | unconstrained tok/s | constrained tok/s | ratio (median) | ratios, all pairs | "
            "mask fill ms/step | step ms u / c |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for name, rows in g.items():
            for bs, r in rows.items():
                lines.append(
                    f"| {name} | {bs} | {r['unconstrained']:.0f} | {r['constrained']:.0f} | {r['ratio']:.3f} | "
                    f"{' '.join(f'{x:.2f}' for x in r.get('ratios', [r['ratio']]))} | "
                    f"{r.get('mask_fill_ms_median', float('nan')):.2f} | "
                    f"{r['unconstrained_step_ms']:.2f} / {r['constrained_step_ms']:.2f} |"
                )
    a = RESULTS.get("attention", {})
    if a:
        backends = sorted({b for v in a.values() for b in v})
        lines.append("")
        lines.append(
            "| attention (32 q / 8 kv heads x 128, bf16) | "
            + " | ".join(f"{b} us (GB/s or TFLOP/s)" for b in backends)
            + " |"
        )
        lines.append("|---|" + "---|" * len(backends))
        for key, per in a.items():
            cells = []
            for b in backends:
                r = per.get(b)
                if r is None:
                    cells.append("-")
                elif key.startswith("decode"):
                    cells.append(f"{r['us']:.1f} ({r['kv_gb_s']:.0f} GB/s)")
                else:
                    cells.append(f"{r['us']:.1f} ({r['tflop_s']:.0f} TFLOP/s)")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if RESULTS.get("errors"):
        lines.append("")
        lines += [f"ERROR {e}" for e in RESULTS["errors"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default=".gpu", help="folder with the model config JSONs and the tokenizer files")
    p.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    p.add_argument("--hf-models", default="llama-3.1-8b", help="models also run through HF transformers")
    p.add_argument("--grammar-models", default="llama-3.1-8b,llama-3.2-1b")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--hf-requests", type=int, default=128)
    p.add_argument(
        "--workload",
        default="sharegpt",
        choices=["sharegpt", "serving"],
        help="throughput requests: ShareGPT-like lengths, or bench_serving.py's random dataset (the options below)",
    )
    p.add_argument("--serving-input-len", type=int, default=400)
    p.add_argument("--serving-output-len", type=int, default=360)
    p.add_argument("--serving-range-ratio", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (bench_serving.py's --seed)")
    p.add_argument("--attention-backends", default="torch,flashinfer,triton")
    p.add_argument("--attention-backend", default="auto", help="the engine's backend")
    p.add_argument("--max-running-requests", type=int, default=None, help="default: the server's for the device")
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="default: the server's for the device")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="default: the server's for the device")
    p.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--quantization", default="none", choices=["none", "fp8"], help="the server's --quantization")
    p.add_argument("--grammar-shards", type=int, default=None, help="default: the server's for the device")
    p.add_argument(
        "--no-busy-poll",
        action="store_true",
        help="grammar hand-off without polling: the scheduler and the grammar workers block",
    )
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="also run decode b1 and throughput with the overlap schedule off (rows '<model> plain')",
    )
    p.add_argument("--skip", default="", help="comma list of: attention,decode,throughput,hf,grammar")
    p.add_argument("--out", default="bench_gpu.json")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script, numbers meaningless")
    p.add_argument("--grammar-batch-sizes", default="1,32,256")
    p.add_argument(
        "--grammar-repeats",
        type=int,
        default=5,
        help="unconstrained/constrained pairs per batch size; the median pair's ratio is reported",
    )
    p.add_argument(
        "--profile",
        default="",
        help="write a cProfile of the scheduler at the largest grammar batch size (constrained and not) into this file",
    )
    p.add_argument(
        "--no-feed-models", default="", help="grammar models whose constrained section also runs without the token feed"
    )
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.time()

    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu, mem, bw = props.name, props.total_memory / 2**30, copy_bandwidth()
    else:
        gpu, mem, bw = "cpu (smoke run)", 0.0, 1e11
    RESULTS["env"] = {
        "gpu": gpu,
        "gpu_mem_gib": mem,
        "torch": torch.__version__,
        "copy_bw_tb_s": bw / 1e12,
        "argv": sys.argv,
    }
    try:
        import flashinfer

        RESULTS["env"]["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001
        pass
    log.info("env %s", RESULTS["env"])
    RESULTS["models"] = [m for m in args.models.split(",") if m]  # --models "": the attention section alone
    save(args.out)

    if "attention" not in skip:
        import importlib.util

        names = [b for b in args.attention_backends.split(",") if b == "torch" or importlib.util.find_spec(b)]
        bench_attention(names)
        save(args.out)

    for name in list(RESULTS["models"]):
        model_json = os.path.join(args.assets, f"{name}.json")
        cfg = json.load(open(model_json))
        vocab = 49152  # the tokenizer's vocabulary: prompts stay inside it
        if args.workload == "serving":
            reqs = serving_workload(
                args.num_requests, args.seed, args.serving_input_len, args.serving_output_len, args.serving_range_ratio
            )
        else:
            reqs = workload(args.num_requests, args.seed, vocab)
        hf_subset = reqs[: args.hf_requests]
        hf_out = round(statistics.mean(n for _, n in reqs))
        engine_kw = dict(
            attention_backend=args.attention_backend,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            grammar_shards=args.grammar_shards,
            quantization=args.quantization,
        )
        engine_kw = {k: v for k, v in engine_kw.items() if v is not None}  # the rest: ServerArgs' device defaults
        if args.compare_plain:
            plain = Engine(model_json, args.assets, grammar=False, overlap_schedule="off", **engine_kw)
            if "decode" not in skip:
                bench_decode_b1(plain, name + " plain", bw)
            if "throughput" not in skip:
                bench_throughput(plain, name + " plain", reqs)
            plain.close()
            del plain
            RESULTS["models"].insert(RESULTS["models"].index(name), name + " plain")
            save(args.out)
        eng = Engine(
            model_json,
            args.assets,
            grammar=name in args.grammar_models.split(","),
            busy_poll=not args.no_busy_poll,
            overlap_schedule=args.overlap_schedule,
            **engine_kw,
        )
        RESULTS.setdefault("engine", {})[name] = {
            "start_s": eng.start_seconds,
            **eng.info.__dict__,
            "hidden": cfg["hidden_size"],
            "layers": cfg["num_hidden_layers"],
            "settings": eng.config.settings.to_dict(),
        }
        log.info("engine %s: %s", name, RESULTS["engine"][name])
        if "decode" not in skip:
            bench_decode_b1(eng, name, bw)
        if "throughput" not in skip:
            bench_throughput(eng, name, reqs)
        save(args.out)
        if "hf" not in skip and name in args.hf_models.split(","):
            bench_subset(eng, name, hf_subset, hf_out)
        grammar_bs = tuple(int(b) for b in args.grammar_batch_sizes.split(","))
        if "grammar" not in skip and name in args.grammar_models.split(","):
            bench_grammar(eng, name, grammar_bs, repeats=args.grammar_repeats, profile=args.profile)
        save(args.out)
        eng.close()
        del eng
        if "grammar" not in skip and name in args.no_feed_models.split(","):
            eng = Engine(
                model_json,
                args.assets,
                grammar=True,
                token_feed=False,
                overlap_schedule=args.overlap_schedule,
                **engine_kw,
            )
            bench_grammar(eng, name + " no-feed", grammar_bs, repeats=args.grammar_repeats)
            save(args.out)
            eng.close()
            del eng
        if "hf" not in skip and name in args.hf_models.split(","):
            bench_hf(model_json, name, hf_subset, hf_out)
            save(args.out)
    RESULTS["total_s"] = time.time() - t_start
    save(args.out)
    print("\n" + table())


if __name__ == "__main__":
    main()
