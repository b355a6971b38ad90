"""The grammar worker: a process that serves compile and per-step mask requests from the scheduler.

There are ``--grammar-shards`` of them; the scheduler's GrammarClient puts each constrained request in one
(its *shard*), which compiles its grammar, keeps its matcher, accepts its tokens and fills its bitmask row.

Masks are written into a shared-memory bitmask ([max_running_requests, ceil(vocab / 32)] int32, bit set =
token allowed; `grammar_shm.py`) that the scheduler reads after its forward: no mask bytes cross the socket.
Under the overlap schedule the tokens to accept come through the token feed (`token_feed`, which describes that
protocol), straight from the sampler.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time

import torch
import zmq

from gramserve.config import ServerConfig
from gramserve.gc_pauses import freeze_heap
from gramserve.grammar.backends.base import GrammarOptions
from gramserve.grammar.disk_cache import default_cache_dir
from gramserve.grammar.grammar_shm import attach_grammar_shm
from gramserve.grammar.service import GrammarService
from gramserve.grammar.token_feed import FeedReader, ShardState, take_fed_ids
from gramserve.ipc import SCHEDULER_GRAMMAR_IN, exit_when_parent_dies, grammar_inbox, pull_socket, push_socket
from gramserve.messages import GrammarCompileReq, GrammarStepReq, GrammarStepResp

logger = logging.getLogger(__name__)

GIL_SWITCH_S = 0.0005
WATCH_MS = 50  # poll period while requests wait for compiles (their time limits)


def worker_name(shard: int, shards: int) -> str:
    """How logs name grammar worker `shard` of `shards`."""
    return "grammar-worker" if shards == 1 else f"grammar-worker{shard}"


def run_grammar_worker(config: ServerConfig, ready_pipe, shard: int = 0) -> None:
    """Entry point (multiprocessing spawn) of grammar worker `shard`; `config.launch.grammar_shm` names the
    shared memory of the bitmask and the token feed."""
    args, settings, launch = config.args, config.settings, config.launch
    name = worker_name(shard, settings.grammar_shards)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s [{name}] %(levelname)s %(message)s")
    exit_when_parent_dies()
    torch.set_num_threads(1)
    # Compile threads run pure Python (the schema checks: ~1 ms a new schema) with the GIL held; at the default
    # 5 ms switch interval the thread that answers steps waited up to 5 ms for it while the batch waited for the
    # masks (many new schemas at once doubled TPOT on a GPU). 0.5 ms bounds that wait.
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(launch.tokenizer_dir)
        shared = attach_grammar_shm(launch.grammar_shm, settings.max_running_requests, launch.vocab_size)
        options = GrammarOptions(
            max_whitespace=args.grammar_max_whitespace,
            strict_json=args.grammar_strict_json,
            max_string_length=args.grammar_max_string_length,
            max_array_items=args.grammar_max_array_items,
            loop_guard=args.grammar_loop_guard,
            text_tokens=launch.grammar_text_tokens,
        )
        service = GrammarService(
            tokenizer,
            launch.vocab_size,
            launch.eos_token_ids,
            options,
            shared.bitmask,
            default_backend=args.grammar_backend,
            compile_timeout_s=args.grammar_compile_timeout,
            fill_threads=settings.grammar_fill_threads,
            cache_dir=default_cache_dir() if args.grammar_cache_dir is None else args.grammar_cache_dir,
            relax=args.grammar_relax,
            # On a CPU the forward is CPU work too: no background comparisons beside it.
            challenge_when_idle=settings.device == "cpu",
            share_fills=args.grammar_share_fills,
        )
        feed = FeedReader(shared.shm.buf, settings.max_running_requests)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher
        logger.exception("grammar worker failed to start")
        ready_pipe.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    ctx = zmq.Context()
    inbox = pull_socket(ctx, launch.replica_path(grammar_inbox(shard)))
    to_scheduler = push_socket(ctx, launch.replica_path(SCHEDULER_GRAMMAR_IN))
    freeze_heap(f"grammar worker {shard}")
    ready_pipe.send({"ok": True})
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    # A compile's end wakes the loop (a byte on this pipe), so its answer goes out at once.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    service.compile_done = functools.partial(_wake, wake_write)
    poller.register(wake_read, zmq.POLLIN)
    busy_until = 0.0  # poll without sleeping until then (GrammarStepReq.busy_poll_ms)
    state = ShardState()
    try:
        while True:
            # While requests wait for compiles, a compile past its time limit is noticed within WATCH_MS.
            timeout = 0 if time.monotonic() < busy_until else WATCH_MS if service.awaited else 1000
            if events := dict(poller.poll(timeout)):
                if wake_read in events:
                    _drain(wake_read)
                while True:
                    try:
                        msg = inbox.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    handle(service, msg, to_scheduler, feed, shard, state)
                    if isinstance(msg, GrammarStepReq) and msg.busy_poll_ms:
                        busy_until = time.monotonic() + msg.busy_poll_ms / 1e3
            for resp in service.poll_compiles():
                to_scheduler.send_pyobj(resp)
            service.start_background()
    finally:
        service.compile_done = None
        service.close()
        os.close(wake_read)
        os.close(wake_write)
        feed.close()
        del service
        shared.close()


def _wake(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:  # full (the loop has wakeups enough pending), or closed at shutdown as a compile thread ended
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def finish_compiles_for(service: GrammarService, rids: list[str], to_scheduler: zmq.Socket) -> None:
    """Wait until none of `rids` waits for a compile, answering compiles meanwhile. The scheduler runs a request
    before its compile answer only when this shard compiled the grammar lately (GrammarClient.compile); if the
    cache has dropped it since, the step that fills its row waits here for the compile (its timeout bounds it)."""
    if not service.awaited:  # the usual case: nothing that requests wait for is compiling, no per-row look
        return
    waiting = [rid for rid in rids if service.flight_of(rid) is not None]
    while waiting:
        for resp in service.poll_compiles(start_background=False):  # no fill-lane compiles before this step's fill
            to_scheduler.send_pyobj(resp)
        waiting = [rid for rid in waiting if service.flight_of(rid) is not None]
        if waiting:
            time.sleep(0.0005)


def handle(
    service: GrammarService,
    msg,
    to_scheduler: zmq.Socket,
    feed: FeedReader,
    shard: int = 0,
    state: ShardState | None = None,
) -> None:
    """Answer one message; `state` is this worker's, kept between calls."""
    state = state if state is not None else ShardState()
    if isinstance(msg, GrammarStepReq):
        finish_compiles_for(service, [rid for rid, _ in msg.fill], to_scheduler)
        try:
            take_fed_ids(msg, state, feed)
            resp = service.step(msg)
            resp.shard = shard
            to_scheduler.send_pyobj(resp)
        except Exception:  # noqa: BLE001 - answer anyway: the scheduler is waiting on this step
            logger.exception("grammar step failed")
            failed = {rid for rid, _ in msg.fill} | {rid for rid, _ in msg.fed}
            to_scheduler.send_pyobj(GrammarStepResp(msg.step, sorted(failed), shard=shard))
    elif isinstance(msg, GrammarCompileReq):
        resp = service.submit(msg)
        if resp is not None:
            to_scheduler.send_pyobj(resp)
    else:
        logger.error("unknown message %r", type(msg))
