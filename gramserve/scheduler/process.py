"""The scheduler process: its entry point and loop (messages in, one scheduler step, tokens out)."""

from __future__ import annotations

import logging
import time

import torch
import zmq

from gramserve.config import ServerConfig
from gramserve.gc_pauses import freeze_heap
from gramserve.ipc import DETOKENIZER_IN, SCHEDULER_IN, exit_when_parent_dies, pull_socket, push_socket
from gramserve.messages import (
    AbortReq,
    BatchTokenOut,
    ControlReq,
    ControlResp,
    GrammarPrefetchReq,
    ReplicaFinished,
    TokenizedGenerateReq,
)
from gramserve.model.parallel import TPConfig
from gramserve.scheduler.grammar_client import GrammarClient
from gramserve.scheduler.scheduler import Scheduler
from gramserve.scheduler.stats import status_line

logger = logging.getLogger(__name__)
STATUS_INTERVAL_S = 10.0  # a one-line status at INFO this often while there is work
LORA_POLL_MS = 5  # how often an idle loop looks for finished LoRA reads


def run_scheduler_process(config: ServerConfig, ready_pipe, heartbeat=None, tp: TPConfig = TPConfig()) -> None:
    """Entry point of the scheduler process (multiprocessing spawn). `heartbeat`: a shared double the loop sets to
    time.monotonic() at every turn (the main process's /health reads it: server/health.py). `tp`: with tensor
    parallelism, rank 0's place in its group (the other ranks run scheduler/tp_worker.py)."""
    name = f"scheduler-dp{config.launch.replica}" if config.args.dp_size > 1 else "scheduler"
    logging.basicConfig(level=config.args.log_level.upper(), format=f"%(asctime)s [{name}] %(levelname)s %(message)s")
    exit_when_parent_dies()
    try:
        torch.set_num_threads(config.settings.scheduler_threads)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.launch.tokenizer_dir)
        ctx = zmq.Context()
        grammar = GrammarClient(config, ctx) if config.launch.grammar_shm else None
        scheduler = Scheduler(config, tokenizer, grammar, tp)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher, which exits with it
        logger.exception("scheduler failed to start")
        ready_pipe.send({"error": f"{type(exc).__name__}: {exc}"})
        return
    inbox = pull_socket(ctx, config.launch.replica_path(SCHEDULER_IN))
    outputs = Outputs(push_socket(ctx, config.ipc_path(DETOKENIZER_IN)))
    if config.args.dp_size > 1:  # control answers and finished requests go to the data-parallel controller
        outputs = Outputs(outputs.to_detok, push_socket(ctx, config.ipc_path(SCHEDULER_IN)), config.launch.replica)
    freeze_heap(name)
    ready_pipe.send({"ok": True, "runner": scheduler.runner.info.__dict__})
    try:
        loop(scheduler, inbox, outputs, heartbeat)
    finally:
        scheduler.runner.close()


class Outputs:
    """Where the loop's messages go: token outputs to the detokenizer; control answers there too, or, under data
    parallelism, to the controller, which also hears of every request that ended."""

    def __init__(self, to_detok: zmq.Socket, to_controller: zmq.Socket | None = None, replica: int = 0):
        self.to_detok, self.to_controller, self.replica = to_detok, to_controller, replica

    def tokens(self, out: BatchTokenOut) -> None:
        self.to_detok.send_pyobj(out)
        if self.to_controller is not None:
            ended = [rid for rid, f in zip(out.rids, out.finished) if f is not None]
            if ended:
                self.to_controller.send_pyobj(ReplicaFinished(self.replica, ended))

    def control(self, resp: ControlResp) -> None:
        resp.replica = self.replica
        (self.to_controller or self.to_detok).send_pyobj(resp)


def loop(scheduler: Scheduler, inbox: zmq.Socket, outputs: Outputs, heartbeat=None) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    if scheduler.grammar is not None:
        poller.register(scheduler.grammar.inbox, zmq.POLLIN)
    last_report, last_status = scheduler.server_info(), time.monotonic()
    while True:
        now = time.monotonic()
        if heartbeat is not None:
            heartbeat.value = now
        if now - last_status >= STATUS_INTERVAL_S:
            report = scheduler.server_info()
            line = status_line(last_report, report, now - last_status)
            if line is not None:
                logger.info("%s", line)
            last_report, last_status = report, now
        # Block only when there is nothing to compute (a compile result also wakes us). While LoRA files are read on
        # their thread and nothing runs, look again every few ms instead of spinning.
        if scheduler.waits_only_for_adapters:
            timeout = LORA_POLL_MS
        else:
            timeout = 0 if scheduler.has_work else 1000
        if timeout:
            scheduler.phases.idle()  # the wait is not the last decode step's time
        events = dict(poller.poll(timeout=timeout))
        scheduler.poll_grammar()
        for qid, payload in scheduler.finished_lora_loads():
            outputs.control(ControlResp(qid, payload))
        while inbox in events or inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            events = {}
            try:
                handle_message(scheduler, msg, outputs)
            except Exception:  # noqa: BLE001 - one bad message fails its own request, never the loop
                logger.exception("could not handle %s", type(msg).__name__)
                if isinstance(msg, TokenizedGenerateReq):
                    outputs.tokens(scheduler.reject(msg.rid, "internal error while admitting the request"))
        t0 = time.perf_counter()
        try:
            out = scheduler.step()
        except Exception:  # noqa: BLE001 - a failing batch must not take the server down
            logger.exception("step failed; aborting the running requests")
            out = scheduler.abort_all("internal error while running the batch (see server log)")
        if out is not None and out.rids:
            outputs.tokens(out)
        if out is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("step: %d reqs in %.1f ms", len(out.rids), (time.perf_counter() - t0) * 1e3)


def handle_message(scheduler: Scheduler, msg, outputs: Outputs) -> None:
    if isinstance(msg, TokenizedGenerateReq):
        scheduler.add_request(msg)
    elif isinstance(msg, GrammarPrefetchReq):
        if scheduler.grammar is not None:
            scheduler.grammar.prefetch(msg.grammar)
    elif isinstance(msg, AbortReq):
        out = scheduler.abort(msg.rid)
        if out is not None:
            outputs.tokens(out)
    elif isinstance(msg, ControlReq):
        if msg.kind == "server_info":
            payload = scheduler.server_info()
        elif msg.kind == "flush_cache":
            payload = scheduler.flush_cache()
        elif msg.kind == "load_lora":
            payload = scheduler.load_lora(msg.qid, msg.args["lora_id"], msg.args["path"])
            if payload is None:
                return  # answered once its files are read (loop: finished_lora_loads)
        elif msg.kind == "unload_lora":
            payload = scheduler.unload_lora(msg.args["lora_id"])
        else:
            payload = {"error": f"unknown control request {msg.kind}"}
        outputs.control(ControlResp(msg.qid, payload))
    else:
        logger.error("unknown message %r", type(msg))
