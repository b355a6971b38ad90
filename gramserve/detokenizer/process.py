"""The Detokenizer process: BatchTokenOut from the scheduler -> BatchTextOut to the TokenizerManager.

`DetokenizerManager` holds the per-request decoding state and is socket-free (unit-testable);
`run_detokenizer_process` is the spawn entry point that wires it to ZeroMQ.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from gramserve.config import ServerConfig
from gramserve.detokenizer.incremental import IncrementalDecoder, StopStringFilter
from gramserve.detokenizer.pacing import OutputPacer
from gramserve.gc_pauses import freeze_heap
from gramserve.ipc import DETOKENIZER_IN, TOKENIZER_MANAGER_IN, exit_when_parent_dies, pull_socket, push_socket
from gramserve.messages import BatchTextOut, BatchTokenOut, FinishReason

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    decoder: IncrementalDecoder
    stop_filter: StopStringFilter


def _empty_text_out() -> BatchTextOut:
    return BatchTextOut(
        rids=[],
        text_deltas=[],
        new_token_ids=[],
        finished=[],
        prompt_tokens=[],
        completion_tokens=[],
        cached_tokens=[],
        logprobs=[],
    )


def _append(out: BatchTextOut, batch: BatchTokenOut, i: int, delta: str, finished: FinishReason | None) -> None:
    out.rids.append(batch.rids[i])
    out.text_deltas.append(delta)
    out.new_token_ids.append(batch.new_token_ids[i])
    out.finished.append(finished)
    out.prompt_tokens.append(batch.prompt_tokens[i])
    out.completion_tokens.append(batch.completion_tokens[i])
    out.cached_tokens.append(batch.cached_tokens[i])
    out.logprobs.append(batch.logprobs[i])
    out.grammar_backends.append(batch.grammar_backends[i] if batch.grammar_backends else None)


class DetokenizerManager:
    """Per-request incremental decoding and stop-string handling, keyed by rid."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        # Requests already finished here (stop string, or an internal error) whose finish the
        # scheduler has not yet reported: their further tokens are dropped silently.
        self.finished_early: set[str] = set()

    def handle_batch(self, batch: BatchTokenOut) -> BatchTextOut | None:
        """Turn one scheduler step's tokens into text deltas; None if nothing to report."""
        out = _empty_text_out()
        for i, rid in enumerate(batch.rids):
            sched_finish = batch.finished[i]
            if rid in self.finished_early:
                if sched_finish is not None:
                    self.finished_early.discard(rid)
                continue
            state = self.states.get(rid)
            if state is None:
                state = _RequestState(
                    IncrementalDecoder(self.tokenizer, skip_special_tokens=batch.skip_special_tokens[i]),
                    StopStringFilter(
                        batch.stop_strs[i], keep=bool(batch.include_stop_strs and batch.include_stop_strs[i])
                    ),
                )
                self.states[rid] = state
            if state.stop_filter.stop_strs and not batch.stop_strs[i]:
                state.stop_filter.turn_off()  # the scheduler's stop strings went off: a tool call began
            new_ids = batch.new_token_ids[i]
            text_ids = new_ids
            if (
                sched_finish is not None
                and isinstance(sched_finish.matched, int)
                and new_ids
                and new_ids[-1] == sched_finish.matched
            ):
                text_ids = new_ids[:-1]  # the EOS / stop token ends the answer; its text is not part of it
            delta = state.stop_filter.push(state.decoder.decode(text_ids, finish=sched_finish is not None))
            finished = sched_finish
            if state.stop_filter.matched is not None:
                # The detokenizer is authoritative for text: a stop string overrides the scheduler's reason.
                finished = FinishReason(type="stop", matched=state.stop_filter.matched)
                if sched_finish is None:
                    self.finished_early.add(rid)
            elif sched_finish is not None:
                delta += state.stop_filter.flush()
            if finished is not None:
                del self.states[rid]
            if delta or new_ids or finished is not None:
                _append(out, batch, i, delta, finished)
        return out if out.rids else None

    def abort_batch(self, batch: BatchTokenOut, error: BaseException) -> BatchTextOut:
        """After a failure handling `batch`, finish its requests with an abort instead of leaving them hanging."""
        out = _empty_text_out()
        reason = FinishReason(type="abort", message=f"detokenizer error: {error!r}")
        for i, rid in enumerate(batch.rids):
            if rid in self.finished_early and batch.finished[i] is None:
                continue  # already reported finished
            self.states.pop(rid, None)
            if batch.finished[i] is None:
                self.finished_early.add(rid)
            else:
                self.finished_early.discard(rid)
            _append(out, batch, i, "", reason)
        return out


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="[%(asctime)s detokenizer] %(levelname)s %(name)s: %(message)s",
    )


def run_detokenizer_process(config: ServerConfig, ready_pipe: Any) -> None:
    """Entry point of the Detokenizer process (multiprocessing spawn target)."""
    import zmq
    from transformers import AutoTokenizer

    _setup_logging(config.args.log_level)
    exit_when_parent_dies()
    manager = DetokenizerManager(AutoTokenizer.from_pretrained(config.launch.tokenizer_dir))

    ctx = zmq.Context()
    recv_sock = pull_socket(ctx, config.ipc_path(DETOKENIZER_IN))
    send_sock = push_socket(ctx, config.ipc_path(TOKENIZER_MANAGER_IN))
    max_interval = config.args.stream_interval_max_ms / 1e3
    pacer = OutputPacer(max_interval) if max_interval > 0 else None
    freeze_heap("detokenizer")
    ready_pipe.send("ready")
    logger.info("detokenizer ready")

    try:
        while True:
            due = pacer.next_due() if pacer is not None else None
            if due is not None:  # held outputs: wait for the next step only until they are due
                wait = due - time.monotonic()
                if wait <= 0 or not recv_sock.poll(math.ceil(wait * 1e3)):
                    out = pacer.take_due(time.monotonic())
                    if out is not None:
                        send_sock.send_pyobj(out)
                    continue
            msg = recv_sock.recv_pyobj()
            if not isinstance(msg, BatchTokenOut):
                send_sock.send_pyobj(msg)  # e.g. ControlResp: forwarded unchanged
                continue
            try:
                out = manager.handle_batch(msg)
            except Exception as e:
                logger.exception("failed to detokenize a batch of %d requests; aborting them", len(msg.rids))
                try:
                    out = manager.abort_batch(msg, e)
                except Exception:
                    logger.exception("could not abort the failed batch either")
                    continue
            if out is not None and pacer is not None:
                out = pacer.push(out, len(manager.states), time.monotonic())
            if out is not None:
                send_sock.send_pyobj(out)
    except KeyboardInterrupt:
        pass
