"""The Scheduler process: waiting queue, continuous batching over a paged KV pool, forward, sampling.

One loop iteration: take new messages, pick a batch (new requests' prefill first, else one decode step
of everything running), run the model, sample, send the new tokens to the detokenizer, free what finished.

Overlap schedule (default on CUDA): a step launches its forward, then reads the previous step's sampled tokens
(finish checks, grammar accepts, detokenizer hand-off) while the GPU computes, and only then launches its own
sampling. Decode inputs are gathered on the device from `last_tokens`, so a batch can be built before its
input tokens reach the host. A request that finished in step N still runs in step N+1; that row is dropped.
Constrained rows: this step's masks depend on the previous step's tokens. The sampler hands those tokens to
the grammar process itself (the token feed, `grammar/token_feed.py`), which accepts them and fills the next
masks while the scheduler launches the next forward and does its own bookkeeping.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from gramserve.config import ServerArgs
from gramserve.ipc import DETOKENIZER_IN, SCHEDULER_IN, exit_when_parent_dies, pull_socket, push_socket
from gramserve.messages import (
    AbortReq, BatchTokenOut, ControlReq, ControlResp, FinishReason, TokenizedGenerateReq, TokenLogprob,
)
from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.runner import ModelRunner
from gramserve.sampling.grammar_masks import MaskApplier
from gramserve.sampling.sampler import PendingSample, SampleResult, Sampler
from gramserve.scheduler.grammar_client import GrammarClient
from gramserve.scheduler.memory import ReqToTokenPool, TokenSlotAllocator
from gramserve.scheduler.radix_cache import RadixCache
from gramserve.scheduler.request import Req

logger = logging.getLogger(__name__)

LPM_WINDOW = 128  # waiting requests scored by prefix match per step (bounds the policy's cost)


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
class _DecodeRows:
    """The device tensors of the last decode batch. The next decode batch of the same requests, each one token on
    (steady decode), reuses them: its positions are these seq_lens."""

    reqs: list[Req]
    seq_lens: list[int]
    rows_dev: torch.Tensor
    seq_lens_dev: torch.Tensor


@dataclass
class _Sampled:
    """A step whose sampled tokens are still on their way to the host."""

    reqs: list[Req]  # in result-row order
    pending: PendingSample
    fed: bool = False  # the constrained rows' ids went to the grammar process through the token feed


class StepPhases:
    """Host time per part of the scheduler's step (ms, cumulative; /get_server_info shows them).

    launch_forward: pick the batch and queue the forward; wait_tokens: wait for the previous step's sampled ids;
    record_tokens: per-request bookkeeping of those ids (under overlap also asking for the masks of rows the token
    feed does not refill); output: build the detokenizer message and free what finished; grammar_feed: tell the
    grammar processes which of this step's sampled ids will reach them through the token feed (overlap);
    grammar_apply: wait for the grammar masks and apply them; launch_sampling: queue the sampling.
    """

    NAMES = ("launch_forward", "wait_tokens", "record_tokens", "output", "grammar_feed", "grammar_apply",
             "launch_sampling")

    def __init__(self):
        self.ms = dict.fromkeys(self.NAMES, 0.0)
        self.steps = 0
        self._t = 0.0

    def start(self) -> None:
        self.steps += 1
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] += (now - self._t) * 1e3
        self._t = now

    def snapshot(self) -> dict:
        return {"steps": self.steps, **{k: round(v, 3) for k, v in self.ms.items()}}


def use_overlap(setting: str, device: torch.device) -> bool:
    if setting == "auto":
        return device.type == "cuda"
    return setting == "on"


class Scheduler:
    def __init__(self, args: ServerArgs, tokenizer, grammar: GrammarClient | None = None):
        self.args = args
        self.grammar = grammar
        self.grammar_wait: dict[str, Req] = {}  # compiling constraints, by rid
        self.tokenizer = tokenizer
        self.runner = ModelRunner(args, args.max_running_requests)
        self.device = self.runner.device
        info = self.runner.info
        self.context_length = info.context_length
        self.allocator = TokenSlotAllocator(info.max_total_tokens, self.device)
        self.req_pool = ReqToTokenPool(args.max_running_requests, self.context_length, self.device)
        self.runner.init_cuda_graphs(self.req_pool.table)  # GPU: decode graphs read this table
        self.sampler = Sampler(info.vocab_size, len(tokenizer), self.device, args.sampling_backend)
        self.eos_ids = set(args.eos_token_ids or info.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.cache = RadixCache(self.allocator, disabled=args.disable_radix_cache)
        self.overlap = use_overlap(args.overlap_schedule, self.device)
        self.mask_applier: MaskApplier | None = None
        if grammar is not None:
            grammar.attach(self.device, use_feed=self.overlap)  # first: on CUDA it page-locks the masks' memory
            self.mask_applier = MaskApplier(grammar.bitmask, self.device, pinned=grammar.pinned)
        # The last sampled token of each request row, written on the device by sampling, read by decode.
        self.last_tokens = torch.zeros(args.max_running_requests, dtype=torch.long, device=self.device)
        self.inflight: _Sampled | None = None  # overlap: the previous step, not yet read back
        self._last_decode: _DecodeRows | None = None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is being prefilled chunk by chunk
        self.finished_early: list[Req] = []  # rejected before running; reported by the next step
        self._prefills_in_a_row = 0  # prefill steps since the last decode step
        self.max_consecutive_prefills = args.max_consecutive_prefills  # while requests decode; 0: no limit
        self.phases = StepPhases()
        self.stats = {"requests_finished": 0, "prompt_tokens": 0, "generation_tokens": 0, "forward_steps": 0,
                      "retractions": 0, "cached_prompt_tokens": 0}

    # --- arrival --------------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReq) -> Req:
        budget = self.context_length - len(msg.input_ids)
        max_new = budget if msg.sampling.max_new_tokens is None else min(msg.sampling.max_new_tokens, budget)
        req = Req(msg, max(max_new, 1), self.eos_ids)
        queued = len(self.waiting) + len(self.grammar_wait)
        if max_new < 1 or len(msg.input_ids) + 1 > self.allocator.size:
            req.finished = FinishReason("abort", message="prompt does not fit in the KV cache / context",
                                        status_code=400)
        elif self.args.max_queued_requests is not None and queued >= self.args.max_queued_requests:
            req.finished = FinishReason("abort", message=f"the waiting queue is full ({queued} requests); retry later",
                                        status_code=503)
        elif req.grammar is not None:
            if self.grammar is None:
                req.finished = FinishReason("abort", message="structured output is disabled on this server",
                                            status_code=400)
            else:
                self.grammar.compile(req.rid, req.grammar)
                self.grammar_wait[req.rid] = req
                return req
        if req.finished is not None:
            self.finished_early.append(req)
        else:
            self.waiting.append(req)
        return req

    def poll_grammar(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose grammar did not."""
        if self.grammar is None:
            return
        for resp in self.grammar.poll_compiles():
            req = self.grammar_wait.pop(resp.rid, None)
            if req is None:
                continue  # aborted meanwhile
            if resp.error is not None:
                req.finished = FinishReason("abort", message=f"invalid or unsupported grammar: {resp.error}",
                                            status_code=400)
                self.finished_early.append(req)
            else:
                req.grammar_backend = resp.backend
                self.waiting.append(req)

    # --- KV bookkeeping -------------------------------------------------------------------------

    def _reserved_slots(self) -> int:
        """Slots kept free for the tokens that running requests are still expected to generate."""
        ratio = self.args.kv_reserve_ratio
        return int(sum(r.remaining_new_tokens() for r in self.running) * ratio)

    def _available_slots(self) -> int:
        return self.allocator.num_free + self.cache.evictable_size

    def _alloc(self, n: int) -> torch.Tensor:
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def _release(self, req: Req) -> None:
        """Give a request's KV back: computed tokens go into the prefix cache, duplicates are freed."""
        if self.grammar is not None:
            self.grammar.release_slot(req.rid)
        if req.req_pool_idx is None:
            return
        slots = self.req_pool.slots(req.req_pool_idx, req.kv_len)
        computed = min(req.kv_len, len(req.fill_ids))  # K/V past fill_ids: a step whose token never came
        self.allocator.free(slots[computed:])
        slots = slots[:computed]
        already = self.cache.insert(req.fill_ids[:computed], slots) if computed else 0
        dup_end = max(already, req.prefix_len)
        self.allocator.free(slots[req.prefix_len:dup_end])  # our own copies of what the tree already had
        if self.cache.disabled:
            self.allocator.free(slots[req.prefix_len:])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.prefix_node = None, None
        req.kv_len = req.prefix_len = 0

    def _retract_for(self, needed: int) -> None:
        """Decode ran out of slots: send the requests with the least progress back to the waiting queue."""
        victims = sorted(self.running, key=lambda r: (len(r.output_ids), -r.arrival))
        while self._available_slots() < needed and len(self.running) > 1 and victims:
            req = victims.pop(0)
            self.running.remove(req)
            self._release(req)  # its tokens stay in the prefix cache, so resuming is cheap if not evicted
            req.num_retractions += 1
            self.stats["retractions"] += 1
            self.waiting.appendleft(req)
            logger.info("retracted %s after %d tokens (KV pool full)", req.rid, len(req.output_ids))

    # --- batches --------------------------------------------------------------------------------

    def _ordered_waiting(self) -> list[Req]:
        if self.args.schedule_policy == "lpm" and not self.cache.disabled and len(self.waiting) > 1:
            head = list(self.waiting)[:LPM_WINDOW]
            hit = {id(r): self.cache.match_prefix(r.fill_ids[:-1]).length for r in head}
            head.sort(key=lambda r: (-hit[id(r)], r.priority, r.arrival))
            return head + list(self.waiting)[LPM_WINDOW:]
        return sorted(self.waiting, key=lambda r: (r.priority, r.arrival))

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        """Pick (request, new tokens) pairs for one extend step within the token and memory budgets."""
        if not (self.waiting or self.chunked):
            return []
        chunk_size = self.args.chunked_prefill_size
        budget = chunk_size if chunk_size > 0 else self.args.max_prefill_tokens
        picked: list[tuple[Req, int]] = []
        if self.chunked is not None:
            req = self.chunked
            take = min(len(req.fill_ids) - req.kv_len, budget, self._available_slots())
            if take > 0:  # else wait for running requests to finish and free memory
                picked.append((req, take))
                budget -= take
        reserved = self._reserved_slots()
        taken = sum(n for _, n in picked)
        rows_left = self.req_pool.num_free
        for req in self._ordered_waiting():
            if budget <= 0 or rows_left == 0 or self.chunked is not None:
                break
            match = self.cache.match_prefix(req.fill_ids[:-1])
            extend = len(req.fill_ids) - match.length
            take = min(extend, budget) if chunk_size > 0 else extend
            if chunk_size <= 0 and picked and take > budget:
                break
            reserve = int(req.remaining_new_tokens() * self.args.kv_reserve_ratio) if take == extend else 0
            self.cache.lock(match.node)  # locking makes the matched prefix unevictable: count it first
            room = self._available_slots() - taken
            if take > room or (take + reserve > room - reserved and (picked or self.running)):
                self.cache.unlock(match.node)
                break
            self.waiting.remove(req)
            self._admit(req, match)
            picked.append((req, take))
            taken += take
            reserved += reserve
            budget -= take
            rows_left -= 1
            if take < extend:
                self.chunked = req
        return picked

    def _admit(self, req: Req, match) -> None:
        """Give a request its slot-table row and the cached prefix (already locked by the caller)."""
        req.req_pool_idx = self.req_pool.alloc()
        req.prefix_node = match.node
        req.prefix_len = req.kv_len = match.length
        if match.length:
            self.req_pool.write(req.req_pool_idx, 0, match.slots)
        if not req.admitted_once:
            req.cached_tokens = match.length
            req.admitted_once = True
            self.stats["cached_prompt_tokens"] += match.length

    def _prefill_batch(self, picked: list[tuple[Req, int]]) -> ForwardBatch:
        slots = self._alloc(sum(n for _, n in picked))
        ids, positions, rows, prefix_lens, new_lens = [], [], [], [], []
        offset = 0
        for req, n in picked:
            start = req.kv_len
            self.req_pool.write(req.req_pool_idx, start, slots[offset:offset + n])
            offset += n
            ids += req.fill_ids[start:start + n]
            positions.append(torch.arange(start, start + n))
            rows.append(req.req_pool_idx)
            prefix_lens.append(start)
            new_lens.append(n)
            req.kv_len += n
        return self._make_batch(ForwardMode.EXTEND, ids, torch.cat(positions), slots, rows,
                                [p + n for p, n in zip(prefix_lens, new_lens)], prefix_lens, new_lens)

    def _decode_batch(self, reqs: list[Req]) -> ForwardBatch:
        slots = self._alloc(len(reqs))
        positions = [r.kv_len for r in reqs]
        for req in reqs:
            req.kv_len += 1
        last = self._last_decode
        if last is not None and reqs == last.reqs and positions == last.seq_lens:
            # The same requests as the last decode step, one token on: no host-to-device copies.
            rows_dev, positions_dev = last.rows_dev, last.seq_lens_dev
        else:
            rows_dev = self._to_device([r.req_pool_idx for r in reqs])
            positions_dev = self._to_device(positions)
        seq_lens, seq_lens_dev = [p + 1 for p in positions], positions_dev + 1
        self._last_decode = _DecodeRows(reqs, seq_lens, rows_dev, seq_lens_dev)
        # One scatter for the whole batch (a write per request costs a kernel launch each on a GPU).
        self.req_pool.table[rows_dev, positions_dev] = slots.to(self.req_pool.table.dtype)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            # Each request's input is the token it sampled last, which may still be on the device (overlap).
            input_ids=self.last_tokens[rows_dev], positions=positions_dev, out_cache_loc=slots,
            req_pool_indices=rows_dev, seq_lens=seq_lens_dev, seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=positions, extend_seq_lens_cpu=[1] * len(reqs), req_to_token=self.req_pool.table)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        # non_blocking: a plain host-to-device copy would wait for every kernel already queued (overlap).
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _make_batch(self, mode, ids, positions, locs, rows, seq_lens, prefix_lens, new_lens) -> ForwardBatch:
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=ids if isinstance(ids, torch.Tensor) else self._to_device(ids),
            positions=positions.to(dev, non_blocking=True),
            out_cache_loc=locs.to(dev),
            req_pool_indices=self._to_device(rows),
            seq_lens=self._to_device(seq_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=new_lens,
            req_to_token=self.req_pool.table,
        )

    # --- one step -------------------------------------------------------------------------------

    @property
    def _last_was_prefill(self) -> bool:
        """The last forward step was a prefill (extend) step."""
        return self._prefills_in_a_row > 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.chunked or self.finished_early or self.inflight)

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
        # While requests decode, at most `max_consecutive_prefills` prefill steps run between two decode steps, so
        # a burst of new prompts stalls the running streams for a bounded time.
        limit = self.max_consecutive_prefills
        if not self.running or limit == 0 or self._prefills_in_a_row < limit:
            picked = self._schedule_prefill()
        if picked:
            self._prefills_in_a_row += 1
            batch = self._prefill_batch(picked)
            reqs = [r for r, _ in picked]
            # Only requests whose whole prompt is now in the cache sample a token.
            sampling = [r for r in reqs if r.kv_len == len(r.fill_ids)]
            self.stats["prompt_tokens"] += sum(batch.extend_seq_lens_cpu)
        elif any(r.finished is None for r in self.running):
            self._prefills_in_a_row = 0
            if self._available_slots() < len(self.running):
                self._retract_for(len(self.running))
            # Not those finished since the last step's output (a grammar rejection): they leave `running` next.
            reqs = sampling = [r for r in self.running if r.finished is None]
            batch = self._decode_batch(reqs)
        else:
            return None
        grammar = None
        if not self.overlap:  # every input token is known: masks are filled while the model runs
            grammar = self._masks_for(self._grammar_rows(reqs, sampling))
        try:
            logits = self.runner.forward(batch)
        except Exception:
            if grammar is not None:
                self.grammar.wait(grammar.step)
            raise
        self.stats["forward_steps"] += 1
        for req in sampling if picked else ():  # their prefill is complete: they decode from now on
            if req is self.chunked:
                self.chunked = None
            if req.finished is None:
                self.running.append(req)
        return _Forward(reqs, sampling, logits, grammar, batch.req_pool_indices)

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
        logits = fwd.logits if len(rows) == len(fwd.reqs) else fwd.logits[self._to_device(rows)]
        if all(r.plain_greedy for r in reqs):
            pending = self.sampler.launch_greedy(logits)
        else:
            want_lp = [r.top_logprobs if r.return_logprob else -1 for r in reqs]
            pending = self.sampler.launch(logits, [r.sampling_row() for r in reqs], max(want_lp))
        pool_rows = fwd.pool_rows if reqs is fwd.reqs else self._to_device([r.req_pool_idx for r in reqs])
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
            if req.return_logprob:
                top = result.top_logprobs[i][: req.top_logprobs] if result.top_logprobs else []
                req.pending_logprobs.append(TokenLogprob(tok, result.logprobs[i], top))
            if req.finished is not None and req.req_pool_idx is None and req in self.waiting:
                self.waiting.remove(req)  # retracted while its last token was in flight
            got.append(req)
        self.stats["generation_tokens"] += len(got)
        self.phases.lap("record_tokens")
        return got

    def _apply_grammar(self, fwd: _Forward, masks: _Masks) -> None:
        self.grammar.wait(masks.step)
        rejected = self.grammar.take_rejected(r.rid for r in fwd.reqs)
        for req in fwd.reqs if rejected else ():
            if req.rid in rejected and req.finished is None:
                req.finished = FinishReason("abort", message="the grammar rejected a token (internal error)",
                                            status_code=500)
                self.finished_early.append(req)  # reported by the next step's output
        t0 = time.perf_counter()
        self.mask_applier.apply(fwd.logits, masks.pairs)
        self.grammar.timing["apply_ms"] += (time.perf_counter() - t0) * 1e3

    def _output(self, reqs: list[Req]) -> BatchTokenOut:
        # One comprehension per field: this runs every step for every running request.
        out = BatchTokenOut(
            rids=[r.rid for r in reqs],
            new_token_ids=[r.output_ids[r.sent_tokens:] for r in reqs],
            finished=[r.finished for r in reqs],
            prompt_tokens=[r.prompt_len for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
            logprobs=[r.pending_logprobs if r.return_logprob else None for r in reqs],
            stop_strs=[r.params.stop for r in reqs],
            skip_special_tokens=[r.params.skip_special_tokens for r in reqs],
            grammar_backends=[r.grammar_backend for r in reqs])
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
        req = self.grammar_wait.pop(rid, None)
        if req is None:
            req = next((r for r in self.waiting if r.rid == rid), None)
            if req is not None:
                self.waiting.remove(req)
        if req is None:
            req = next((r for r in self.running if r.rid == rid), None)
            if req is not None:
                self.running.remove(req)
        if req is None and self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
        if req is None or req.finished is not None:
            return None
        req.finished = FinishReason("abort", message="aborted")
        return self._output([req])

    def abort_all(self, message: str) -> BatchTokenOut:
        live = list(self.running) + list(self.waiting) + list(self.grammar_wait.values())
        if self.chunked is not None and self.chunked not in live:
            live.append(self.chunked)
        live = [r for r in live if r.finished is None]
        done = [r for r in self.finished_early if r not in live]  # already failed: keep their own reason
        self.running, self.waiting, self.grammar_wait, self.chunked = [], deque(), {}, None
        self.inflight, self.finished_early = None, []
        for req in live:
            req.finished = FinishReason("abort", message=message, status_code=500)
        return self._output(done + live)

    def flush_cache(self) -> dict:
        if self.has_work or self.grammar_wait:
            return {"ok": False, "error": "cannot flush the cache while requests are running or waiting"}
        self.cache.reset()
        return {"ok": True}

    def server_info(self) -> dict:
        return {
            "runner": self.runner.info.__dict__,
            "sampling_backend": self.sampler.backend,
            "kv_pool": {
                "total_slots": self.allocator.size,
                "free_slots": self.allocator.num_free,
                # held by requests (their own slots and the cached prefixes they lock)
                "used_slots": self.allocator.size - self.allocator.num_free - self.cache.evictable_size,
                "cached_slots": self.cache.total_size(),
                "evictable_slots": self.cache.evictable_size,
                "free_request_rows": self.req_pool.num_free,
                "max_running_requests": self.req_pool.max_reqs,
            },
            "prefix_cache": {
                "enabled": not self.cache.disabled,
                "hit_tokens": self.cache.stats.hit_tokens,
                "query_tokens": self.cache.stats.query_tokens,
                "cached_prompt_tokens": self.stats["cached_prompt_tokens"],
            },
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_grammar_compiling": len(self.grammar_wait),
            "stats": dict(self.stats),
            "grammar_timing": dict(self.grammar.timing) if self.grammar is not None else {},
            "grammar_slots_in_use": self.grammar.slots_in_use if self.grammar is not None else 0,
            "grammar_requests_per_shard": list(self.grammar.placed) if self.grammar is not None else [],
            "grammar_live_requests": self.grammar.live_requests if self.grammar is not None else 0,
            "step_phases_ms": self.phases.snapshot(),
        }


def run_scheduler_process(args: ServerArgs, tokenizer_dir: str, ready_pipe) -> None:
    """Entry point of the scheduler process (multiprocessing spawn)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [scheduler] %(levelname)s %(message)s")
    exit_when_parent_dies()
    try:
        torch.set_num_threads(args.num_threads or default_num_threads())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        ctx = zmq.Context()
        grammar = GrammarClient(args, ctx) if args.grammar_shm else None
        scheduler = Scheduler(args, tokenizer, grammar)
        torch.set_num_threads(args.num_threads or default_num_threads(scheduler.device))
    except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits with it
        logger.exception("scheduler failed to start")
        ready_pipe.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    inbox = pull_socket(ctx, args.ipc_path(SCHEDULER_IN))
    to_detok = push_socket(ctx, args.ipc_path(DETOKENIZER_IN))
    ready_pipe.send({"ok": True, "runner": scheduler.runner.info.__dict__})
    loop(scheduler, inbox, to_detok)


GPU_HOST_THREADS = 2


def default_num_threads(device: torch.device | None = None) -> int:
    """Torch CPU threads for the scheduler process."""
    if device is not None and device.type == "cuda":
        # The model runs on the GPU; host tensor ops are small (ids, bitmask copies). Idle OpenMP threads spin
        # after each parallel op and would take cores from the grammar process's fill threads.
        return GPU_HOST_THREADS
    # Leave one core to the HTTP server and detokenizer: torch's OpenMP threads spin, and on a
    # small machine a contended core slows every matmul several-fold.
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 1) if cores <= 4 else cores - 2


def loop(scheduler: Scheduler, inbox: zmq.Socket, to_detok: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    if scheduler.grammar is not None:
        poller.register(scheduler.grammar.inbox, zmq.POLLIN)
    while True:
        idle = not scheduler.has_work
        # Block only when there is nothing to compute (a compile result also wakes us).
        events = dict(poller.poll(timeout=1000 if idle else 0))
        scheduler.poll_grammar()
        while inbox in events or inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            events = {}
            handle_message(scheduler, msg, to_detok)
        t0 = time.perf_counter()
        try:
            out = scheduler.step()
        except Exception:  # noqa: BLE001 - a failing batch must not take the server down
            logger.exception("step failed; aborting the running requests")
            out = scheduler.abort_all("internal error while running the batch (see server log)")
        if out is not None and out.rids:
            to_detok.send_pyobj(out)
        if out is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("step: %d reqs in %.1f ms", len(out.rids), (time.perf_counter() - t0) * 1e3)


def handle_message(scheduler: Scheduler, msg, to_detok: zmq.Socket) -> None:
    if isinstance(msg, TokenizedGenerateReq):
        scheduler.add_request(msg)
    elif isinstance(msg, AbortReq):
        out = scheduler.abort(msg.rid)
        if out is not None:
            to_detok.send_pyobj(out)
    elif isinstance(msg, ControlReq):
        if msg.kind == "server_info":
            payload = scheduler.server_info()
        elif msg.kind == "flush_cache":
            payload = scheduler.flush_cache()
        else:
            payload = {"error": f"unknown control request {msg.kind}"}
        to_detok.send_pyobj(ControlResp(msg.qid, payload))
    else:
        logger.error("unknown message %r", type(msg))
