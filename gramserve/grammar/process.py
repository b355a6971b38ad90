"""The GrammarBackend process: serves compile and per-step mask requests from the scheduler.

Masks are written into a shared-memory bitmask ([max_running_requests, ceil(vocab / 32)] int32, bit set =
token allowed) that the scheduler reads after its forward: no mask bytes cross the socket.
"""

from __future__ import annotations

import logging
import time
from multiprocessing import shared_memory

import torch
import zmq

from gramserve.config import ServerArgs
from gramserve.grammar.backends.base import GrammarOptions
from gramserve.grammar.service import GrammarService
from gramserve.ipc import GRAMMAR_IN, SCHEDULER_GRAMMAR_IN, exit_when_parent_dies, pull_socket, push_socket
from gramserve.messages import GrammarCompileReq, GrammarStepReq

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def attach_bitmask(name: str, rows: int, vocab_size: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    # Attaching registers the segment with the resource tracker that spawned children share with the
    # launcher; the launcher unlinks it (and unregisters) at shutdown.
    shm = shared_memory.SharedMemory(name=name)
    words = bitmask_words(vocab_size)
    tensor = torch.frombuffer(shm.buf, dtype=torch.int32, count=rows * words).view(rows, words)
    return shm, tensor


def create_bitmask_shm(rows: int, vocab_size: int) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(create=True, size=rows * bitmask_words(vocab_size) * 4)


def run_grammar_process(args: ServerArgs, tokenizer_dir: str, ready_pipe) -> None:
    """Entry point (multiprocessing spawn). args.grammar_shm names the bitmask shared memory."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [grammar] %(levelname)s %(message)s")
    exit_when_parent_dies()
    torch.set_num_threads(1)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        shm, bitmask = attach_bitmask(args.grammar_shm, args.max_running_requests, args.vocab_size)
        options = GrammarOptions(max_whitespace=args.grammar_max_whitespace, strict_json=args.grammar_strict_json,
                                 text_tokens=tuple(args.grammar_text_tokens))
        service = GrammarService(tokenizer, args.vocab_size, args.eos_token_ids, options, bitmask,
                                 default_backend=args.grammar_backend,
                                 compile_timeout_s=args.grammar_compile_timeout,
                                 fill_threads=args.grammar_fill_threads)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher
        logger.exception("grammar process failed to start")
        ready_pipe.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    ctx = zmq.Context()
    inbox = pull_socket(ctx, args.ipc_path(GRAMMAR_IN))
    to_scheduler = push_socket(ctx, args.ipc_path(SCHEDULER_GRAMMAR_IN))
    ready_pipe.send({"ok": True})
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    busy_until = 0.0  # poll without sleeping until then (GrammarStepReq.busy_poll_ms)
    try:
        while True:
            # Poll quickly while compiles are in flight, so their results go out promptly.
            timeout = 0 if time.monotonic() < busy_until else 2 if service.pending else 1000
            if poller.poll(timeout):
                while True:
                    try:
                        msg = inbox.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    handle(service, msg, to_scheduler)
                    if isinstance(msg, GrammarStepReq) and msg.busy_poll_ms:
                        busy_until = time.monotonic() + msg.busy_poll_ms / 1e3
            for resp in service.poll_compiles():
                to_scheduler.send_pyobj(resp)
    finally:
        service.close()
        del bitmask
        shm.close()


def handle(service: GrammarService, msg, to_scheduler: zmq.Socket) -> None:
    if isinstance(msg, GrammarStepReq):
        try:
            to_scheduler.send_pyobj(service.step(msg))
        except Exception:  # noqa: BLE001 - answer anyway: the scheduler is waiting on this step
            logger.exception("grammar step failed")
            from gramserve.messages import GrammarStepResp

            to_scheduler.send_pyobj(GrammarStepResp(msg.step, [rid for rid, _ in msg.fill]))
    elif isinstance(msg, GrammarCompileReq):
        resp = service.submit(msg)
        if resp is not None:
            to_scheduler.send_pyobj(resp)
    else:
        logger.error("unknown message %r", type(msg))
