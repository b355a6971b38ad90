"""The Scheduler: continuous batching over a paged KV pool, one step at a time (forward, sampling, outputs).

One step: pick a batch (new requests' prefill first, else one decode step of everything running), run the model,
sample, send the new tokens to the detokenizer, free what finished. The parts it wires: `admission.py` (waiting queue
order, what to prefill, retraction), `kv_accounting.py` (KV slots), `batch_builder.py` (forward batches) and
`stats.py`; `process.py` runs the process loop that takes new messages and calls `step`.

Overlap schedule (default on CUDA): a step launches its forward, then reads the previous step's sampled tokens
(finish checks, grammar accepts, detokenizer hand-off) while the GPU computes, and only then launches its own
sampling. Decode inputs are gathered on the device from `last_tokens`, so a batch can be built before its
input tokens reach the host. A request that finished in step N still runs in step N+1; that row is dropped.
Constrained rows: this step's masks depend on the previous step's tokens. The sampler hands those tokens to
the grammar process itself (the token feed, `grammar/token_feed.py`), which accepts them and fills the next
masks while the scheduler launches the next forward and does its own bookkeeping.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from gramserve.config import ServerConfig
from gramserve.histogram import Histogram
from gramserve.messages import BatchTokenOut, FinishReason, TokenizedGenerateReq, TokenLogprob
from gramserve.model.lora.adapter import LoRAAdapterError
from gramserve.model.parallel import TPConfig
from gramserve.model.runner import ModelRunner, RunnerConfig
from gramserve.sampling.grammar_masks import MaskApplier
from gramserve.sampling.sampler import PendingSample, Sampler, SampleResult
from gramserve.scheduler.admission import Admission
from gramserve.scheduler.batch_builder import BatchBuilder
from gramserve.scheduler.grammar_client import GrammarClient
from gramserve.scheduler.image_encoder import ImageEncoder
from gramserve.scheduler.kv_accounting import KvAccounting
from gramserve.scheduler.lora_slots import LoRASlots
from gramserve.scheduler.memory import ReqToTokenPool, TokenSlotAllocator
from gramserve.scheduler.radix_cache import RadixCache
from gramserve.scheduler.request import Req
from gramserve.scheduler.stats import StepPhases, server_info_report, zero_counters

LOGPROB_FLOOR = -9999.0  # a token's logprob when the model's was NaN or -inf (OpenAI's floor)
# Device memory for the last logits rows of prompts prefilled while their grammar compiles (Scheduler.parked); past
# it, such requests wait for their compile in the queue instead.
PARKED_LOGITS_BYTES = 64 << 20


@dataclass
class _Forward:
    """A batch whose forward has been launched."""

    reqs: list[Req]  # one logits row each
    sampling: list[Req]  # those that sample a token this step
    logits: torch.Tensor
    grammar: _Masks | None  # plain schedule: the masks asked for before the forward
    pool_rows: torch.Tensor  # the requests' slot-table rows, on the device


@dataclass
class _Masks:
    """The grammar masks of one step: wait for grammar step `step`, then mask each (logits row, slot)."""

    step: int = 0
    pairs: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Sampled:
    """A step whose sampled tokens are still on their way to the host."""

    reqs: list[Req]  # in result-row order
    pending: PendingSample
    fed: bool = False  # the constrained rows' ids went to the grammar process through the token feed


def runner_config(config: ServerConfig, tp: TPConfig = TPConfig()) -> RunnerConfig:
    """The model runner's share of the server configuration (`tp`: this rank's place, with tensor parallelism)."""
    args, settings = config.args, config.settings
    return RunnerConfig(
        model_path=args.model_path,
        load_format=args.load_format,
        device=settings.device,
        dtype=settings.dtype,
        quantization=args.quantization,
        attention_backend=settings.attention_backend,
        context_length=args.context_length,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=settings.max_running_requests,
        max_step_tokens=settings.chunked_prefill_size or args.max_prefill_tokens,
        cuda_graph_max_bs=settings.cuda_graph_max_bs,
        prefill_graph_max_tokens=settings.prefill_graph_max_tokens,
        seed=args.seed,
        cpu_weights=args.cpu_weights,
        cpu_kernel_threads=settings.cpu_kernel_threads,
        lora_slots=settings.max_loras_per_batch if settings.max_lora_rank else 0,
        max_lora_rank=settings.max_lora_rank or 16,
        lora_target_modules=settings.lora_target_modules,
        tp=tp,
    )


class Scheduler:
    """Runs one step at a time over `admission` (what to prefill), `kv` (KV slots), `batches` and the model."""

    def __init__(
        self, config: ServerConfig, tokenizer, grammar: GrammarClient | None = None, tp: TPConfig = TPConfig()
    ):
        self.config = config
        args, settings = config.args, config.settings
        self.max_queued_requests = args.max_queued_requests or None  # 0: no limit
        self.grammar = grammar
        self.grammar_wait: dict[str, Req] = {}  # compiling constraints, by rid
        self.grammar_early: dict[str, Req] = {}  # admitted before their compile answer (GrammarClient.compile)
        # Prefilled while their grammar compiled, by rid, each with its last logits row (Req.saved_logits): waiting
        # for the compile (in grammar_wait too; Req.grammar_pending), then for the next step, which samples them.
        self.parked: dict[str, Req] = {}
        self._stalled = False  # the last step found nothing to run while parked requests held what waiting ones need
        # Where a request's time to first token goes on this side: waiting for its compile answer, and from its
        # arrival here to its first token (free and constrained apart). The client's TTFT less the latter is the
        # main process's share (HTTP, template, tokenizing, streaming).
        self.grammar_wait_hist = Histogram()
        self.first_token_hist = {"free": Histogram(), "constrained": Histogram()}
        self.tokenizer = tokenizer
        self.runner = ModelRunner(runner_config(config, tp))  # rank 0 of its tensor-parallel group
        self.device = self.runner.device
        info = self.runner.info
        self.max_parked = max(1, PARKED_LOGITS_BYTES // (4 * info.vocab_size))
        self.context_length = info.context_length
        self.allocator = TokenSlotAllocator(info.max_total_tokens, self.device)
        self.req_pool = ReqToTokenPool(settings.max_running_requests, self.context_length, self.device)
        self.runner.init_cuda_graphs(self.req_pool.table)  # GPU: decode graphs read this table
        self.sampler = Sampler(info.vocab_size, len(tokenizer), self.device, settings.sampling_backend)
        self.eos_ids = set(config.launch.eos_token_ids or info.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.cache = RadixCache(self.allocator, disabled=args.disable_radix_cache)
        self.overlap = settings.overlap_schedule
        self.mask_applier: MaskApplier | None = None
        if grammar is not None:
            grammar.attach(self.device, use_feed=self.overlap)  # first: on CUDA it page-locks the masks' memory
            self.mask_applier = MaskApplier(grammar.bitmask, self.device, pinned=grammar.pinned)
        # The last sampled token of each request row, written on the device by sampling, read by decode.
        self.last_tokens = torch.zeros(settings.max_running_requests, dtype=torch.long, device=self.device)
        self.inflight: _Sampled | None = None  # overlap: the previous step, not yet read back
        self.stats = zero_counters()
        self.kv = KvAccounting(self.allocator, self.req_pool, self.cache, args.kv_reserve_ratio)
        self.lora: LoRASlots | None = None
        if self.runner.lora_pool is not None:
            self.lora = LoRASlots(self.runner, settings.max_loaded_loras)
            for lora_id, (_, path) in enumerate(settings.lora_modules, start=1):  # the registry's ids (server/lora)
                self.lora.register(lora_id, path)
        self.admission = Admission(
            self.kv,
            args.schedule_policy,
            settings.chunked_prefill_size,
            args.max_prefill_tokens,
            self.stats,
            self.lora,
        )
        encoder = ImageEncoder(self.runner.model, self.device) if self.runner.config.vision is not None else None
        self.images = encoder
        self.batches = BatchBuilder(self.kv, self.device, self.last_tokens, lora=self.lora is not None, images=encoder)
        self.running: list[Req] = []
        self.finished_early: list[Req] = []  # rejected before running; reported by the next step
        self._prefills_in_a_row = 0  # prefill steps since the last decode step
        self.max_consecutive_prefills = settings.max_consecutive_prefills  # while requests decode; 0: no limit
        self.max_prefill_wait_steps = settings.max_prefill_wait_steps  # while requests decode; 0: no wait
        self._decodes_since_prefill = 0
        # Running requests decode inside prefill steps. Not with LoRA or images, whose prefill batches carry
        # per-request extras that decode rows do not have.
        self.mixed_decode = settings.mixed_decode and self.lora is None and encoder is None
        self.phases = StepPhases()

    # --- arrival --------------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReq) -> Req:
        self._stalled = False
        budget = self.context_length - len(msg.input_ids)
        max_new = budget if msg.sampling.max_new_tokens is None else min(msg.sampling.max_new_tokens, budget)
        req = Req(msg, max(max_new, 1), self.eos_ids)
        if max_new < 1 or len(msg.input_ids) + 1 > self.allocator.size:
            req.finished = FinishReason(
                "abort", message="prompt does not fit in the KV cache / context", status_code=400
            )
        elif self.max_queued_requests is not None and (queued := self._queued()) >= self.max_queued_requests:
            req.finished = FinishReason(
                "abort", message=f"the waiting queue is full ({queued} requests); retry later", status_code=503
            )
        elif req.grammar is not None:
            if self.grammar is None:
                req.finished = FinishReason(
                    "abort", message="structured output is disabled on this server", status_code=400
                )
            elif self.grammar.compile(req.rid, req.grammar):
                self.grammar_early[req.rid] = req
            else:
                self.grammar_wait[req.rid] = req
                # Not with images (their encoder outputs are the prefill's alone), nor an adapter (its slot could go
                # to another adapter while it is parked).
                req.grammar_pending = not req.images and not req.lora_id
                if not req.grammar_pending:
                    return req
        if req.finished is not None:
            self.finished_early.append(req)
        else:
            self.admission.waiting.append(req)
        return req

    def _queued(self) -> int:
        """Requests not running yet: waiting, parked, or waiting for their compile outside the waiting queue (those
        that may not park: images, adapters)."""
        unqueued = sum(not r.grammar_pending for r in self.grammar_wait.values())
        return len(self.admission.waiting) + len(self.parked) + unqueued

    def poll_grammar(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose grammar did not."""
        if self.grammar is None:
            return
        for resp in self.grammar.poll_compiles():
            self._stalled = False
            req = self.grammar_wait.pop(resp.rid, None)
            if req is None:
                req = self.grammar_early.pop(resp.rid, None)
                if req is not None and req.finished is None:
                    req.grammar_backend = resp.backend
                    if resp.error is not None:  # its shard compiled it before: it failed only now (a timeout)
                        self._fail(req, f"invalid or unsupported grammar: {resp.error}", 400)
                continue  # else aborted meanwhile
            if resp.error is not None:
                self._take(req.rid)  # out of the waiting queue, or its KV comes back (held)
                req.finished = FinishReason(
                    "abort", message=f"invalid or unsupported grammar: {resp.error}", status_code=400
                )
                self.finished_early.append(req)
                continue
            req.grammar_backend = resp.backend
            self.grammar_wait_hist.observe((time.monotonic() - req.arrival) * 1e3)
            if not req.grammar_pending:
                self.admission.waiting.append(req)
                continue
            # Still waiting or prefilling: it samples at its prefill's end as any request. Parked: the next step
            # samples it from its saved logits (_take_ready).
            req.grammar_pending = False

    # --- KV bookkeeping -------------------------------------------------------------------------

    def _release(self, req: Req) -> None:
        """A request stopped running: its grammar mask row and its KV (into the prefix cache) go back."""
        if self.grammar is not None:
            self.grammar.release_slot(req.rid)
        self.kv.release(req)

    # --- one step -------------------------------------------------------------------------------

    @property
    def _last_was_prefill(self) -> bool:
        """The last forward step was a prefill (extend) step without decode riders (tests read it)."""
        return self._prefills_in_a_row > 0

    @property
    def has_work(self) -> bool:
        waiting = self.admission.waiting and not self._stalled
        busy = self.running or waiting or self.admission.chunked or self.finished_early or self.inflight
        # Compile answers read during the last step (GrammarClient.wait) wake no poll: take them in the next loop.
        answers = self.grammar is not None and self.grammar.has_answers
        return bool(busy) or answers or self._has_ready

    @torch.inference_mode()
    def step(self) -> BatchTokenOut | None:
        early, self.finished_early = self.finished_early, []
        phases = self.phases
        phases.start()
        try:
            fwd = self._launch_forward()
        except Exception:
            self.finished_early = early + self.finished_early  # still owed to their clients
            raise
        phases.lap("launch_forward")
        if not self.overlap:
            sampled = []
            if fwd is not None:
                pending = self._launch_sampling(fwd, fwd.grammar)
                phases.lap("launch_sampling")
                sampled = self._read_tokens(pending)
            return self._finish_step(early, sampled)
        prev, self.inflight = self.inflight, None
        # While the GPU runs this step's forward: read the previous step's tokens and do the bookkeeping. The
        # grammar process refills the masks of constrained rows meanwhile (token feed); rows without a refilled
        # mask (new requests) are asked for at once, before the bookkeeping.
        result = self._wait_tokens(prev)
        grammar, not_started = self._begin_grammar(fwd) if fwd is not None else (None, [])
        sampled = self._record_tokens(prev, result)
        # Requests whose grammar started with the token just recorded (start_after) need their masks too.
        grammar = self._masks_for([(i, r) for i, r in not_started if r.constrained], grammar)
        out = self._finish_step(early, sampled)
        if fwd is not None:
            self.inflight = self._launch_sampling(fwd, grammar)
            phases.lap("launch_sampling")
        return out

    def _finish_step(self, early: list[Req], sampled: list[Req]) -> BatchTokenOut | None:
        if not (early or sampled):
            return None
        out = self._output(early + sampled)
        self.running = [r for r in self.running if r.finished is None]
        if self.grammar is not None and not any(r.constrained for r in self.running):
            self.grammar.flush()
        self.phases.lap("output")
        return out

    def _launch_forward(self) -> _Forward | None:
        """Pick a batch and launch its forward (on a GPU the call returns before the forward is done)."""
        picked: list[tuple[Req, int]] = []
        if self._may_prefill():
            # Parked requests hold KV and will decode: admission reserves room for them as for running ones.
            holders = self.running + list(self.parked.values()) if self.parked else self.running
            chunked = self.admission.chunked
            parking = len(self.parked) + (chunked is not None and chunked.grammar_pending)
            self.admission.pending_room = self.max_parked - parking
            picked = self.admission.schedule_prefill(holders)
        if self.admission.failed:
            self.finished_early += self.admission.failed
            self.admission.failed = []
        riders: list[Req] = []
        batch = None
        if picked:
            riders = self._riders(picked)
            # Decode rows that ride along are not stalled: the step does not count against the prefill limit.
            self._prefills_in_a_row = 0 if riders else self._prefills_in_a_row + 1
            self._decodes_since_prefill = 0
            batch = self.batches.prefill(picked, riders)
            # Only requests whose whole prompt is now in the cache sample a token; riders' rows come last.
            prompted = [r for r, _ in picked]
            completed = [r for r in prompted if r.kv_len == len(r.fill_ids) and not r.grammar_pending]
            reqs, sampling = prompted + riders, completed + riders
            self.stats["prompt_tokens"] += sum(n for _, n in picked)
            self.stats["mixed_decode_rows"] += len(riders)
        elif any(r.finished is None for r in self.running):
            self._prefills_in_a_row = 0
            self._decodes_since_prefill += 1
            if self.kv.available() < len(self.running):
                # Back to the waiting queue (KV released by admission); their grammar mask rows are free too.
                for req in self.admission.retract_for(len(self.running), self.running):
                    if self.grammar is not None:
                        self.grammar.release_slot(req.rid)
            # Not those finished since the last step's output (a grammar rejection): they leave `running` next.
            reqs = sampling = [r for r in self.running if r.finished is None]
            batch = self.batches.decode(reqs)
            self.phases.decoding(len(reqs))
        elif self._has_ready:  # only parked requests to sample: no forward
            reqs = sampling = []
        else:
            # Nothing runs and the waiting queue cannot go on (parked requests hold the rows or the KV it needs):
            # wait for a compile answer or a new message instead of spinning.
            self._stalled = bool(self.parked)
            return None
        self._stalled = False
        # Taken once the batch is built (nothing before this joins them to `running`, where abort_all finds them):
        # their saved rows follow the batch's own, and they decode from the next step on.
        ready = self._take_ready()
        if ready:
            if sampling is reqs:  # every row samples (`_sampling_rows` tells by identity)
                reqs = sampling = reqs + ready
            else:
                reqs, sampling = reqs + ready, sampling + ready
            self.running += ready
            if self.lora is not None:
                self.running.sort(key=lambda r: r.lora_slot)
        grammar = None
        if not self.overlap:  # every input token is known: masks are filled while the model runs
            grammar = self._masks_for(self._grammar_rows(reqs, sampling))
        logits = self._run_forward(batch, grammar)
        if picked:
            chunked = self.admission.chunked
            for req in completed:  # their prefill is complete: they decode from now on
                if req is chunked:
                    self.admission.chunked = None
                if req.finished is None:
                    self.running.append(req)
            for row, req in enumerate(prompted):  # prefilled while their grammar compiles: parked with their logits
                if req.grammar_pending and req.kv_len == len(req.fill_ids) and req.finished is None:
                    if req is chunked:
                        self.admission.chunked = None
                    req.saved_logits = logits[row].clone()
                    self.parked[req.rid] = req
            if self.lora is not None:  # rows of one adapter side by side: one segment each in decode batches
                self.running.sort(key=lambda r: r.lora_slot)
        if not ready:
            return _Forward(reqs, sampling, logits, grammar, batch.req_pool_indices)
        saved = [r.saved_logits for r in ready]
        for req in ready:
            req.saved_logits = None
        logits = torch.stack(saved) if logits is None else torch.cat([logits, torch.stack(saved)])
        pool_rows = self.batches.to_device([r.req_pool_idx for r in reqs])
        return _Forward(reqs, sampling, logits, grammar, pool_rows)

    def _run_forward(self, batch, grammar: _Masks | None) -> torch.Tensor | None:
        if batch is None:
            return None
        try:
            logits = self.runner.forward(batch)
        except Exception:
            if grammar is not None:
                self.grammar.wait(grammar.step)
            raise
        self.stats["forward_steps"] += 1
        return logits

    @property
    def _has_ready(self) -> bool:
        """A parked request's grammar is ready: a step must sample it."""
        return any(not r.grammar_pending and r.finished is None for r in self.parked.values())

    def _take_ready(self) -> list[Req]:
        """The parked requests whose grammar is ready, out of `parked`: this step samples them from their saved
        logits (their rows follow the batch's own)."""
        if not self.parked:
            return []
        ready = [r for r in self.parked.values() if not r.grammar_pending and r.finished is None]
        for req in ready:
            del self.parked[req.rid]
        self.stats["parked_samples"] += len(ready)
        return ready

    def _may_prefill(self) -> bool:
        """Whether this step may prefill waiting prompts. While requests decode: at most `max_consecutive_prefills`
        prefill steps between two decode steps, so a burst of new prompts stalls the running streams for a bounded
        time; and new prompts wait up to `max_prefill_wait_steps` decode steps after the last prefill step, unless
        they are a quarter of the running requests, so that prompts arriving one by one (as running requests finish
        under a steady load) share prefill steps instead of taking one each."""
        if not self.running:
            return True
        limit = self.max_consecutive_prefills
        if limit and self._prefills_in_a_row >= limit:
            return False
        wait = self.max_prefill_wait_steps
        if not wait or self.admission.chunked is not None or self._decodes_since_prefill >= wait:
            return True
        return 4 * len(self.admission.waiting) >= len(self.running)

    def _riders(self, picked: list[tuple[Req, int]]) -> list[Req]:
        """The running requests that decode inside this prefill step (`mixed_decode`): all of them, if the KV pool
        has a slot for each beside the prompts' tokens; else none (the next decode step retracts if it must)."""
        if not self.mixed_decode:
            return []
        riders = [r for r in self.running if r.finished is None]
        if riders and self.kv.available() < sum(n for _, n in picked) + len(riders):
            return []
        return riders

    @staticmethod
    def _sampling_rows(reqs: list[Req], sampling: list[Req]):
        """(logits row, request) of each request in `reqs` that samples this step."""
        if sampling is reqs:  # a decode batch: every row samples
            return enumerate(reqs)
        samples = {id(r) for r in sampling}  # a set: list membership is quadratic in the batch size
        return ((i, r) for i, r in enumerate(reqs) if id(r) in samples)

    def _grammar_rows(self, reqs: list[Req], sampling: list[Req]) -> list[tuple[int, Req]]:
        return [(i, r) for i, r in self._sampling_rows(reqs, sampling) if r.constrained and r.finished is None]

    def _masks_for(self, rows: list[tuple[int, Req]], masks: _Masks | None = None) -> _Masks | None:
        """Masks for these (logits row, request) pairs, added to `masks`: a request whose slot the token feed
        refills waits for that fill; the others are asked for now (with the accepts queued since the last step)."""
        if not rows:
            return masks
        pairs, step = self.grammar.masks_for([i for i, _ in rows], [r.rid for _, r in rows])
        if masks is None:
            return _Masks(step, pairs)  # the client's own list: the mask applier recognises it next step
        return _Masks(max(masks.step, step), masks.pairs + pairs)

    def _begin_grammar(self, fwd: _Forward) -> tuple[_Masks | None, list[tuple[int, Req]]]:
        """Overlap: the masks of this step's constrained rows (refilled through the token feed, or asked for now).
        Rows of requests that finish with the token being recorded get masks too, and are then dropped.
        Also returns the (row, request) pairs whose grammar has not started yet (waiting for `start_after`)."""
        rows, not_started = [], []
        for i, r in self._sampling_rows(fwd.reqs, fwd.sampling):
            if r.grammar is not None and r.finished is None:
                (rows if r.grammar_started else not_started).append((i, r))
        return self._masks_for(rows), not_started

    def _launch_sampling(self, fwd: _Forward, grammar: _Masks | None) -> _Sampled:
        """Apply grammar masks and queue sampling; the sampled ids go to `last_tokens` on the device (and, under
        overlap, the constrained rows' ids to the grammar processes through the token feed)."""
        # Rows of requests that finished meanwhile (overlap, aborts) are dropped. A request that a grammar
        # rejection finishes while its masks are awaited below still samples (its token is then ignored): the
        # rows, and the feed's positions in them, are fixed before the wait.
        rows = [i for i, r in self._sampling_rows(fwd.reqs, fwd.sampling) if r.finished is None]
        if not rows:
            if grammar is not None:
                self._apply_grammar(fwd, grammar)
            return _Sampled([], PendingSample(torch.empty(0, dtype=torch.long)))
        reqs = fwd.reqs if len(rows) == len(fwd.reqs) else [fwd.reqs[i] for i in rows]
        feed_step = None
        if self.grammar is not None and self.grammar.feeding:
            # Announced before the wait below, so the grammar processes know the rows before the ids land.
            positions = [pos for pos, r in enumerate(reqs) if r.grammar_started]
            feed_step = self.grammar.announce_feed(len(reqs), positions, [reqs[p].rid for p in positions])
            self.phases.lap("grammar_feed")
        if grammar is not None:
            self._apply_grammar(fwd, grammar)
            self.phases.lap("grammar_apply")
        logits = fwd.logits if len(rows) == len(fwd.reqs) else fwd.logits[self.batches.to_device(rows)]
        if all(r.plain_greedy for r in reqs):
            pending = self.sampler.launch_greedy(logits)
        else:
            want_lp = [r.top_logprobs if r.return_logprob else -1 for r in reqs]
            pending = self.sampler.launch(logits, [r.sampling_row() for r in reqs], max(want_lp))
        pool_rows = fwd.pool_rows if reqs is fwd.reqs else self.batches.to_device([r.req_pool_idx for r in reqs])
        self.last_tokens[pool_rows] = pending.token_ids
        if feed_step:
            self.grammar.publish_feed(feed_step, pending.token_ids)
        return _Sampled(reqs, pending, fed=feed_step is not None)

    def _read_tokens(self, sampled: _Sampled) -> list[Req]:
        """Wait for a step's sampled tokens and record them (plain schedule)."""
        return self._record_tokens(sampled, self._wait_tokens(sampled))

    def _wait_tokens(self, sampled: _Sampled | None) -> SampleResult | None:
        """Wait for a step's sampled ids on the host. Unless they went through the token feed, the constrained
        rows' accepts are queued for the next grammar step."""
        if sampled is None or not sampled.reqs:
            return None
        result = sampled.pending.resolve()
        self.phases.lap("wait_tokens")
        if self.grammar is not None and not sampled.fed:
            for req, tok in zip(sampled.reqs, result.token_ids):
                # A request that finishes with this token is accepted too (its matcher is freed next).
                if req.finished is None and req.constrained:
                    self.grammar.accept(req.rid, tok)
        return result

    def _record_tokens(self, sampled: _Sampled | None, result: SampleResult | None) -> list[Req]:
        """Record a step's sampled tokens; returns the requests that got a token."""
        if result is None:
            return []
        got = []
        tokenizer, context_length = self.tokenizer, self.context_length
        for i, (req, tok) in enumerate(zip(sampled.reqs, result.token_ids)):
            if req.finished is not None:  # aborted while its token was in flight
                continue
            req.append_token(tok, tokenizer, context_length)
            if len(req.output_ids) == 1:
                kind = "free" if req.grammar is None else "constrained"
                self.first_token_hist[kind].observe((time.monotonic() - req.arrival) * 1e3)
            if req.return_logprob:
                top = result.top_logprobs[i][: req.top_logprobs] if result.top_logprobs else []
                lp = result.logprobs[i]
                if not math.isfinite(lp):  # NaN logits (a broken adapter or model): JSON has no NaN or inf
                    lp, top = LOGPROB_FLOOR, [(t, v) for t, v in top if math.isfinite(v)]
                req.pending_logprobs.append(TokenLogprob(tok, lp, top))
            if req.finished is not None and req.req_pool_idx is None and req in self.admission.waiting:
                self.admission.waiting.remove(req)  # retracted while its last token was in flight
            got.append(req)
        self.stats["generation_tokens"] += len(got)
        self.phases.lap("record_tokens")
        return got

    def _apply_grammar(self, fwd: _Forward, masks: _Masks) -> None:
        self.grammar.wait(masks.step)
        rejected = self.grammar.take_rejected(r.rid for r in fwd.reqs)
        for req in fwd.reqs if rejected else ():
            if req.rid in rejected and req.finished is None:
                message, status = rejected[req.rid]
                req.finished = FinishReason("abort", message=message, status_code=status)
                self.finished_early.append(req)  # reported by the next step's output
        t0 = time.perf_counter()
        self.mask_applier.apply(fwd.logits, masks.pairs)
        self.grammar.timing["apply_ms"] += (time.perf_counter() - t0) * 1e3

    def _output(self, reqs: list[Req]) -> BatchTokenOut:
        # One comprehension per field: this runs every step for every running request.
        out = BatchTokenOut(
            rids=[r.rid for r in reqs],
            new_token_ids=[r.output_ids[r.sent_tokens :] for r in reqs],
            finished=[r.finished for r in reqs],
            prompt_tokens=[r.prompt_len for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            logprobs=[r.pending_logprobs if r.return_logprob else None for r in reqs],
            stop_strs=[r.live_stop_strs for r in reqs],
            include_stop_strs=[r.params.include_stop_str for r in reqs],
            skip_special_tokens=[r.params.skip_special_tokens for r in reqs],
            grammar_backends=[r.grammar_backend for r in reqs],
        )
        for req in reqs:
            req.sent_tokens = len(req.output_ids)
            if req.return_logprob:
                req.pending_logprobs = []
            if req.finished is not None:
                self._release(req)
                if req.grammar is not None and self.grammar is not None:
                    self.grammar.free(req.rid)
                self.stats["requests_finished"] += 1
        return out

    def abort(self, rid: str) -> BatchTokenOut | None:
        self._stalled = False
        req = self._take(rid)
        if req is None or req.finished is not None:
            return None
        req.finished = FinishReason("abort", message="aborted")
        out = self._output([req])
        if self.grammar is not None and req.grammar is not None and not any(r.constrained for r in self.running):
            # Nothing sends a grammar step soon: the free goes now, so a compile nobody waits for is dropped.
            self.grammar.flush()
        return out

    def _take(self, rid: str) -> Req | None:
        """Remove a request from wherever it waits or runs."""
        self.grammar_early.pop(rid, None)
        waited = self.grammar_wait.pop(rid, None)
        req = self.parked.pop(rid, None) or self.admission.withdraw(rid)
        if req is None and waited is not None and not waited.grammar_pending:
            return waited  # not queued anywhere before its compile answer
        if req is None:
            req = next((r for r in self.running if r.rid == rid), None)
            if req is not None:
                self.running.remove(req)
        if req is not None:
            req.saved_logits = None  # parked: its logits row goes back now
        return req

    def _fail(self, req: Req, message: str, status: int) -> None:
        """End a request with an error, reported by the next step's output."""
        self._take(req.rid)
        req.finished = FinishReason("abort", message=message, status_code=status)
        self.finished_early.append(req)

    def reject(self, rid: str, message: str) -> BatchTokenOut:
        """The output that fails a request whose arrival could not be handled (it holds no KV yet)."""
        if self.grammar_wait.pop(rid, None) is not None or self.grammar_early.pop(rid, None) is not None:
            self.grammar.free(rid)
        self.admission.withdraw(rid)
        return BatchTokenOut.aborted([rid], message, 500)

    def abort_all(self, message: str) -> BatchTokenOut:
        chunked = self.admission.chunked
        live = list(self.running) + list(self.admission.waiting) + list(self.parked.values())
        live += [r for r in self.grammar_wait.values() if not r.grammar_pending]  # the others are queued already
        if chunked is not None and chunked not in live:
            live.append(chunked)
        live = [r for r in live if r.finished is None]
        done = [r for r in self.finished_early if r not in live]  # already failed: keep their own reason
        self.running, self.grammar_wait, self.grammar_early, self.parked = [], {}, {}, {}
        self.admission.clear()
        self.inflight, self.finished_early = None, []
        for req in live:
            req.finished = FinishReason("abort", message=message, status_code=500)
        return self._output(done + live)

    def flush_cache(self) -> dict:
        if self.has_work or self.grammar_wait:
            return {"ok": False, "error": "cannot flush the cache while requests are running or waiting"}
        self.cache.reset()
        return {"ok": True}

    def load_lora(self, qid: str, lora_id: int, path: str) -> dict | None:
        """Register an adapter (ControlReq "load_lora"). Its files are read and checked on the LoRA reader thread;
        finished_lora_loads() gives the answer (None here), or the refusal at once when LoRA is off."""
        if self.lora is None:
            return {"ok": False, "status": 400, "error": "LoRA is off on this server (start it with --enable-lora)"}
        self.lora.register_later(qid, lora_id, path)
        return None

    def finished_lora_loads(self) -> list[tuple[str, dict]]:
        """(qid, answer) of the run-time loads whose read is over."""
        if self.lora is None:
            return []
        answers = []
        for qid, result in self.lora.finished_registrations():
            if isinstance(result, LoRAAdapterError):
                answers.append((qid, {"ok": False, "status": result.status, "error": str(result)}))
            else:
                answers.append((qid, {"ok": True, "rank": result.rank, "modules": sorted(result.target_modules)}))
        return answers

    @property
    def reading_adapters(self) -> bool:
        return self.lora is not None and self.lora.reading

    @property
    def waits_only_for_adapters(self) -> bool:
        """Nothing to compute but requests whose adapter files are being read."""
        busy = self.running or self.admission.chunked or self.finished_early or self.inflight
        return self.reading_adapters and not busy

    def unload_lora(self, lora_id: int) -> dict:
        if self.lora is not None:
            self.lora.unregister(lora_id)
        return {"ok": True}

    def server_info(self) -> dict:
        report = self._server_info()
        report["pid"] = os.getpid()  # the scheduler process (data parallelism: each replica's, under "replicas")
        if self.lora is not None:
            report["lora"] = self.lora.report()
        if self.images is not None:
            report["images"] = dict(self.images.counters, cached=len(self.images.cache))
        report["grammar_wait_ms"] = self.grammar_wait_hist.report()
        report["first_token_ms"] = {kind: h.report() for kind, h in self.first_token_hist.items()}
        return report

    def _server_info(self) -> dict:
        return server_info_report(
            self.runner.info,
            self.sampler.backend,
            self.kv,
            self.stats,
            len(self.running) + (self.admission.chunked is not None),  # parked requests count as compiling
            len(self.admission.waiting) - sum(r.grammar_pending for r in self.admission.waiting),  # those compile
            len(self.grammar_wait),
            self.grammar,
            self.phases,
        )
