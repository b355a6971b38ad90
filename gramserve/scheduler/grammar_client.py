"""The scheduler's side of the GrammarBackend process.

Per step: `begin_step` sends last step's accepted tokens and this step's rows to fill, before the forward;
`finish_step` waits for the fill after the forward, so mask filling overlaps the model. Compile results
arrive asynchronously and are collected with `poll_compiles`.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq

from gramserve.config import ServerArgs
from gramserve.grammar.process import attach_bitmask
from gramserve.ipc import GRAMMAR_IN, SCHEDULER_GRAMMAR_IN, pull_socket, push_socket
from gramserve.messages import GrammarCompileReq, GrammarCompileResp, GrammarRequest, GrammarStepReq, GrammarStepResp
from gramserve.sampling.grammar_masks import MaskApplier

logger = logging.getLogger(__name__)

STEP_TIMEOUT_MS = 60_000
BUSY_POLL_MS = 20.0  # with busy_poll: how long either side polls without sleeping before it blocks


class GrammarProcessError(RuntimeError):
    pass


class GrammarClient:
    def __init__(self, args: ServerArgs, ctx: zmq.Context):
        self.to_grammar = push_socket(ctx, args.ipc_path(GRAMMAR_IN))
        self.inbox = pull_socket(ctx, args.ipc_path(SCHEDULER_GRAMMAR_IN))
        self._shm, self.bitmask = attach_bitmask(args.grammar_shm, args.max_running_requests, args.vocab_size)
        self._step = 0
        self._accept: list[tuple[str, int]] = []
        self._free: list[str] = []
        self._compiled: list[GrammarCompileResp] = []
        self._masks: MaskApplier | None = None  # made on the first apply, for the logits' device
        # Poll for replies without sleeping (the scheduler sets it on a GPU, where the step is short and cores
        # are many): a round trip through a blocked process cost ~0.7 ms more on the H100 host (docs/benchmarks.md).
        self.busy_poll = False
        # Where constrained steps spend the scheduler's time (ms, cumulative; /get_server_info shows them).
        self.timing = {"steps": 0, "wait_after_forward_ms": 0.0, "apply_ms": 0.0, "fill_ms": 0.0}

    def compile(self, rid: str, grammar: GrammarRequest) -> None:
        self.to_grammar.send_pyobj(GrammarCompileReq(rid, grammar))

    def accept(self, rid: str, token: int) -> None:
        self._accept.append((rid, token))

    def free(self, rid: str) -> None:
        self._free.append(rid)

    def begin_step(self, fill: list[tuple[str, int]]) -> int:
        self._step += 1
        self.to_grammar.send_pyobj(GrammarStepReq(self._step, self._accept, fill, self._free,
                                                  BUSY_POLL_MS if self.busy_poll else 0.0))
        self._accept, self._free = [], []
        return self._step

    def flush(self) -> None:
        """Send pending accepts / frees without waiting (their reply is skipped by finish_step)."""
        if self._accept or self._free:
            self.begin_step([])

    def finish_step(self, step: int) -> GrammarStepResp:
        t0 = time.perf_counter()
        resp = self._wait_step(step)
        self.timing["steps"] += 1
        self.timing["wait_after_forward_ms"] += (time.perf_counter() - t0) * 1e3
        self.timing["fill_ms"] += resp.fill_ms
        return resp

    def _wait_step(self, step: int) -> GrammarStepResp:
        spin_until = time.monotonic() + BUSY_POLL_MS / 1e3 if self.busy_poll else 0.0
        while True:
            if time.monotonic() < spin_until:
                try:
                    msg = self.inbox.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    continue
            else:
                if not self.inbox.poll(STEP_TIMEOUT_MS):
                    raise GrammarProcessError(f"no mask from the grammar process for step {step}")
                msg = self.inbox.recv_pyobj()
            if isinstance(msg, GrammarCompileResp):
                self._compiled.append(msg)
            elif isinstance(msg, GrammarStepResp) and msg.step == step:
                return msg

    def poll_compiles(self) -> list[GrammarCompileResp]:
        while True:
            try:
                msg = self.inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(msg, GrammarCompileResp):
                self._compiled.append(msg)
        out, self._compiled = self._compiled, []
        return out

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask `logits[rows]` in place with the bitmask rows of the same index."""
        t0 = time.perf_counter()
        if self._masks is None:
            self._masks = MaskApplier(self.bitmask, logits.device)
        self._masks.apply(logits, rows)
        self.timing["apply_ms"] += (time.perf_counter() - t0) * 1e3
