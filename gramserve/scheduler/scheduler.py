"""The Scheduler process: waiting queue, continuous batching over a paged KV pool, forward, sampling.

One loop iteration: take new messages, pick a batch (new requests' prefill first, else one decode step
of everything running), run the model, sample, send the new tokens to the detokenizer, free what finished.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import torch
import zmq

from gramserve.config import ServerArgs
from gramserve.ipc import DETOKENIZER_IN, SCHEDULER_IN, exit_when_parent_dies, pull_socket, push_socket
from gramserve.messages import (
    AbortReq, BatchTokenOut, ControlReq, ControlResp, FinishReason, TokenizedGenerateReq, TokenLogprob,
)
from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.runner import ModelRunner
from gramserve.sampling.sampler import Sampler
from gramserve.scheduler.memory import ReqToTokenPool, TokenSlotAllocator
from gramserve.scheduler.request import Req

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, tokenizer):
        self.args = args
        self.tokenizer = tokenizer
        self.runner = ModelRunner(args, args.max_running_requests)
        self.device = self.runner.device
        info = self.runner.info
        self.context_length = info.context_length
        self.allocator = TokenSlotAllocator(info.max_total_tokens, self.device)
        self.req_pool = ReqToTokenPool(args.max_running_requests, self.context_length, self.device)
        self.sampler = Sampler(info.vocab_size, len(tokenizer), self.device)
        self.eos_ids = set(info.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = {"requests_finished": 0, "prompt_tokens": 0, "generation_tokens": 0, "forward_steps": 0}

    # --- admission and KV bookkeeping ---------------------------------------------------------------

    def _reserved_slots(self) -> int:
        """Slots that running requests will still need for the tokens they may generate."""
        return sum(r.remaining_new_tokens() for r in self.running)

    def add_request(self, msg: TokenizedGenerateReq) -> Req:
        budget = self.context_length - len(msg.input_ids)
        max_new = budget if msg.sampling.max_new_tokens is None else min(msg.sampling.max_new_tokens, budget)
        req = Req(msg, max(max_new, 1), self.eos_ids)
        if max_new < 1 or len(msg.input_ids) + max_new > self.allocator.size:
            req.finished = FinishReason("abort", message="prompt does not fit in the KV cache / context")
        self.waiting.append(req)
        return req

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        free = self.allocator.num_free - self._reserved_slots()
        tokens = 0
        while self.waiting:
            req = self.waiting[0]
            if req.finished is not None:  # rejected at arrival; reported by the next output batch
                self.waiting.popleft()
                admitted.append(req)
                continue
            need = req.prompt_len + req.max_new_tokens
            if len(self.running) + len(admitted) >= self.req_pool.max_reqs or need > free:
                break
            if admitted and tokens + req.prompt_len > self.args.max_prefill_tokens:
                break
            self.waiting.popleft()
            free -= need
            tokens += req.prompt_len
            admitted.append(req)
        return admitted

    def _free_req(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.allocator.free(self.req_pool.slots(req.req_pool_idx, req.kv_len))
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
            req.kv_len = 0

    # --- batches --------------------------------------------------------------------------------

    def _prefill_batch(self, reqs: list[Req]) -> ForwardBatch:
        ids, positions, locs, rows, prefix_lens, new_lens = [], [], [], [], [], []
        for req in reqs:
            req.req_pool_idx = self.req_pool.alloc()
            fill = req.all_ids  # output_ids is non-empty only for a resumed request
            slots = self.allocator.alloc(len(fill))
            self.req_pool.write(req.req_pool_idx, 0, slots)
            req.kv_len = len(fill)
            ids += fill
            positions.append(torch.arange(len(fill)))
            locs.append(slots)
            rows.append(req.req_pool_idx)
            prefix_lens.append(0)
            new_lens.append(len(fill))
        return self._make_batch(ForwardMode.EXTEND, ids, torch.cat(positions), torch.cat(locs), rows,
                                [p + n for p, n in zip(prefix_lens, new_lens)], prefix_lens, new_lens)

    def _decode_batch(self, reqs: list[Req]) -> ForwardBatch:
        slots = self.allocator.alloc(len(reqs))
        ids, positions, rows = [], [], []
        for req, slot in zip(reqs, slots):
            positions.append(req.kv_len)
            self.req_pool.table[req.req_pool_idx, req.kv_len] = slot
            req.kv_len += 1
            ids.append(req.output_ids[-1])
            rows.append(req.req_pool_idx)
        seq_lens = [r.kv_len for r in reqs]
        return self._make_batch(ForwardMode.DECODE, ids, torch.tensor(positions), slots, rows,
                                seq_lens, [s - 1 for s in seq_lens], [1] * len(reqs))

    def _make_batch(self, mode, ids, positions, locs, rows, seq_lens, prefix_lens, new_lens) -> ForwardBatch:
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions.to(dev),
            out_cache_loc=locs.to(dev),
            req_pool_indices=torch.tensor(rows, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=new_lens,
            req_to_token=self.req_pool.table,
        )

    # --- one step -------------------------------------------------------------------------------

    def step(self) -> BatchTokenOut | None:
        admitted = self._admit()
        rejected = [r for r in admitted if r.finished is not None]
        new_reqs = [r for r in admitted if r.finished is None]
        if new_reqs:
            self.running.extend(new_reqs)  # before the forward, so a failure frees their slots too
            reqs, batch = new_reqs, self._prefill_batch(new_reqs)
            self.stats["prompt_tokens"] += sum(batch.extend_seq_lens_cpu)
        elif self.running:
            reqs, batch = self.running, self._decode_batch(self.running)
        else:
            return self._output(rejected) if rejected else None

        logits = self.runner.forward(batch)
        want_lp = [r.top_logprobs if r.return_logprob else -1 for r in reqs]
        result = self.sampler.sample(logits, [r.sampling_row() for r in reqs], max(want_lp))
        self.stats["forward_steps"] += 1
        self.stats["generation_tokens"] += len(reqs)
        for i, (req, tok) in enumerate(zip(reqs, result.token_ids)):
            req.append_token(tok, self.tokenizer, self.context_length)
            if req.return_logprob:
                top = result.top_logprobs[i][: req.top_logprobs] if result.top_logprobs else []
                req.pending_logprobs.append(TokenLogprob(tok, result.logprobs[i], top))
        out = self._output(rejected + reqs)
        self.running = [r for r in self.running if r.finished is None]
        return out

    def _output(self, reqs: list[Req]) -> BatchTokenOut:
        out = BatchTokenOut([], [], [], [], [], [], [], [], [])
        for req in reqs:
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[req.sent_tokens:])
            req.sent_tokens = len(req.output_ids)
            out.finished.append(req.finished)
            out.prompt_tokens.append(req.prompt_len)
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            out.logprobs.append(req.pending_logprobs if req.return_logprob else None)
            req.pending_logprobs = []
            out.stop_strs.append(req.params.stop)
            out.skip_special_tokens.append(req.params.skip_special_tokens)
            if req.finished is not None:
                self._free_req(req)
                self.stats["requests_finished"] += 1
        return out

    def abort(self, rid: str) -> BatchTokenOut | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid and req.finished is None:
                    req.finished = FinishReason("abort", message="aborted")
                    if queue is self.waiting:
                        self.waiting.remove(req)
                    else:
                        self.running.remove(req)
                    return self._output([req])
        return None

    def abort_all(self, message: str) -> BatchTokenOut:
        reqs = list(self.running) + list(self.waiting)
        self.running, self.waiting = [], deque()
        for req in reqs:
            req.finished = FinishReason("abort", message=message)
        return self._output(reqs)

    def server_info(self) -> dict:
        return {
            "runner": self.runner.info.__dict__,
            "kv_pool": {
                "total_slots": self.allocator.size,
                "free_slots": self.allocator.num_free,
                "used_slots": self.allocator.size - self.allocator.num_free,
                "free_request_rows": self.req_pool.num_free,
                "max_running_requests": self.req_pool.max_reqs,
            },
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "stats": dict(self.stats),
        }


def run_scheduler_process(args: ServerArgs, tokenizer_dir: str, ready_pipe) -> None:
    """Entry point of the scheduler process (multiprocessing spawn)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [scheduler] %(levelname)s %(message)s")
    exit_when_parent_dies()
    try:
        torch.set_num_threads(args.num_threads or default_num_threads())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        scheduler = Scheduler(args, tokenizer)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits with it
        logger.exception("scheduler failed to start")
        ready_pipe.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    ctx = zmq.Context()
    inbox = pull_socket(ctx, args.ipc_path(SCHEDULER_IN))
    to_detok = push_socket(ctx, args.ipc_path(DETOKENIZER_IN))
    ready_pipe.send({"ok": True, "runner": scheduler.runner.info.__dict__})
    loop(scheduler, inbox, to_detok)


def default_num_threads() -> int:
    # Leave one core to the HTTP server and detokenizer: torch's OpenMP threads spin, and on a
    # small machine a contended core slows every matmul several-fold.
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 1) if cores <= 4 else cores - 2


def loop(scheduler: Scheduler, inbox: zmq.Socket, to_detok: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        idle = not scheduler.running and not scheduler.waiting
        # Block only when there is nothing to compute.
        events = dict(poller.poll(timeout=1000 if idle else 0))
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
        payload = scheduler.server_info() if msg.kind == "server_info" else {"error": f"unknown {msg.kind}"}
        to_detok.send_pyobj(ControlResp(msg.qid, payload))
    else:
        logger.error("unknown message %r", type(msg))
