"""The data-parallel controller: one process between the TokenizerManager and `--dp-size` model replicas.

It takes the scheduler's inbox (the TokenizerManager does not know that replicas exist) and:

* routes each new request to one live replica (`--load-balance-method`): `round_robin`; `shortest_queue`, the
  replica with the fewest requests routed to it and not yet ended (exact: every replica reports the requests that
  ended); `prefix_affinity`, the replica that last served a request starting with the same tokens (its prefix
  cache holds them), unless that replica has `AFFINITY_SLACK` more requests than the least loaded one;
* sends an abort to the replica that holds the request;
* asks every live replica a control query (server info, cache flush, LoRA load / unload) and answers with the
  merged replies (server info: counts summed, each replica's report under `replicas`);
* when the main process reports a replica dead (`ReplicaDown`), fails that replica's unfinished requests with a
  503 (through the detokenizer, which drops their state) and routes only to the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from gramserve.config import ServerConfig
from gramserve.gc_pauses import freeze_heap
from gramserve.ipc import (
    DETOKENIZER_IN,
    SCHEDULER_IN,
    TOKENIZER_MANAGER_IN,
    exit_when_parent_dies,
    pull_socket,
    push_socket,
)
from gramserve.messages import (
    AbortReq,
    BatchTokenOut,
    ControlReq,
    ControlResp,
    ReplicaDown,
    ReplicaFinished,
    TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)
AFFINITY_PREFIX_TOKENS = 32  # requests whose first tokens are equal share a replica under prefix_affinity
AFFINITY_KEYS = 65536  # prefixes remembered (least recently used forgotten)
AFFINITY_SLACK = 8  # requests more than the least loaded replica past which affinity gives way
CONTROL_TIMEOUT_S = 30.0  # a control query still missing replies after this is answered with what came


@dataclass
class _Query:
    """A control query sent to several replicas, waiting for their replies."""

    kind: str
    waiting: set[int]
    replies: dict[int, dict] = field(default_factory=dict)
    sent_at: float = field(default_factory=time.monotonic)


class Router:
    """Which replica takes a request; knows the requests each replica holds."""

    def __init__(self, replicas: int, method: str):
        self.method = method
        self.alive = list(range(replicas))
        self.holds: list[set[str]] = [set() for _ in range(replicas)]
        self.owner: dict[str, int] = {}
        self._turn = itertools.count()
        self._affinity: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def route(self, req: TokenizedGenerateReq) -> int | None:
        if not self.alive:
            return None
        if req.replica in self.alive:  # pinned (the warm-up runs every case on every replica)
            replica = req.replica
        elif self.method == "round_robin":
            replica = self.alive[next(self._turn) % len(self.alive)]
        elif self.method == "prefix_affinity":
            replica = self._by_prefix(tuple(req.input_ids[:AFFINITY_PREFIX_TOKENS]))
        else:
            replica = self._least_loaded()
        self.holds[replica].add(req.rid)
        self.owner[req.rid] = replica
        return replica

    def _least_loaded(self) -> int:
        return min(self.alive, key=lambda r: (len(self.holds[r]), r))

    def _by_prefix(self, key: tuple[int, ...]) -> int:
        least = self._least_loaded()
        replica = self._affinity.get(key)
        if replica not in self.alive or len(self.holds[replica]) > len(self.holds[least]) + AFFINITY_SLACK:
            replica = least
        self._affinity[key] = replica
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_KEYS:
            self._affinity.popitem(last=False)
        return replica

    def ended(self, replica: int, rids: list[str]) -> None:
        for rid in rids:
            self.holds[replica].discard(rid)
            if self.owner.get(rid) == replica:
                del self.owner[rid]

    def down(self, replica: int) -> list[str]:
        """Stop routing to `replica`; returns the requests it held."""
        if replica in self.alive:
            self.alive.remove(replica)
        lost, self.holds[replica] = sorted(self.holds[replica]), set()
        for rid in lost:
            self.owner.pop(rid, None)
        return lost


def _sum_counts(reports: list[dict]) -> dict:
    """Numbers added over the reports (nested dicts key by key); anything else taken from the first."""
    out = dict(reports[0])
    for key, value in reports[0].items():
        values = [r.get(key) for r in reports]
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            out[key] = sum(values)
        elif isinstance(value, dict) and all(isinstance(v, dict) for v in values):
            out[key] = _sum_counts(values)
    return out


def merge_replies(kind: str, replies: dict[int, dict], replicas: int) -> dict:
    """One answer from every live replica's reply to a control query."""
    if not replies:
        return {"error": "no model replica is alive"}
    ordered = [replies[r] for r in sorted(replies)]
    failed = next((p for p in ordered if "error" in p), None)
    if kind != "server_info":
        return failed if failed is not None else ordered[0]
    merged = dict(ordered[0])
    for key in ("kv_pool", "stats", "prefix_cache"):
        if all(isinstance(p.get(key), dict) for p in ordered):
            merged[key] = _sum_counts([p[key] for p in ordered])
    for key in ("num_running", "num_waiting", "num_grammar_compiling"):
        if all(isinstance(p.get(key), int) for p in ordered):
            merged[key] = sum(p[key] for p in ordered)
    merged["data_parallel"] = {"dp_size": replicas, "alive": sorted(replies), "replicas": ordered}
    return merged


class Controller:
    def __init__(self, config: ServerConfig, ctx: zmq.Context):
        self.replicas = config.args.dp_size
        self.router = Router(self.replicas, config.args.load_balance_method)
        self.inbox = pull_socket(ctx, config.ipc_path(SCHEDULER_IN))
        self.to_replica = [
            push_socket(ctx, config.launch.ipc_path(f"dp{r}/{SCHEDULER_IN}")) for r in range(self.replicas)
        ]
        self.to_detok = push_socket(ctx, config.ipc_path(DETOKENIZER_IN))
        self.to_tm = push_socket(ctx, config.ipc_path(TOKENIZER_MANAGER_IN))
        self.queries: dict[str, _Query] = {}

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            replica = self.router.route(msg)
            if replica is None:
                self.to_detok.send_pyobj(BatchTokenOut.aborted([msg.rid], "no model replica is alive", 503))
            else:
                self.to_replica[replica].send_pyobj(msg)
        elif isinstance(msg, AbortReq):
            replica = self.router.owner.get(msg.rid)
            if replica is not None:
                self.to_replica[replica].send_pyobj(msg)
        elif isinstance(msg, ReplicaFinished):
            self.router.ended(msg.replica, msg.rids)
        elif isinstance(msg, ControlReq):
            self.queries[msg.qid] = _Query(msg.kind, set(self.router.alive))
            for replica in self.router.alive:
                self.to_replica[replica].send_pyobj(msg)
            self._answer_ready()
        elif isinstance(msg, ControlResp):
            query = self.queries.get(msg.qid)
            if query is not None:
                query.replies[msg.replica] = msg.payload
            self._answer_ready()
        elif isinstance(msg, ReplicaDown):
            self._replica_down(msg.replica, msg.reason)
        else:
            logger.error("unknown message %r", type(msg))

    def _replica_down(self, replica: int, reason: str) -> None:
        lost = self.router.down(replica)
        logger.error("replica %d is down (%s): failing its %d requests", replica, reason, len(lost))
        if lost:
            message = f"the model replica serving this request failed ({reason}); retry"
            self.to_detok.send_pyobj(BatchTokenOut.aborted(lost, message, 503))
        for query in self.queries.values():
            query.waiting.discard(replica)
        self._answer_ready()

    def _answer_ready(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for qid, query in list(self.queries.items()):
            if query.waiting <= set(query.replies) or now - query.sent_at > CONTROL_TIMEOUT_S:
                replies = {r: p for r, p in query.replies.items() if r in query.waiting}
                self.to_tm.send_pyobj(ControlResp(qid, merge_replies(query.kind, replies, self.replicas)))
                del self.queries[qid]

    def run(self) -> None:
        while True:
            if self.inbox.poll(1000 if not self.queries else 100):
                self.handle(self.inbox.recv_pyobj())
            elif self.queries:
                self._answer_ready()


def run_dp_controller_process(config: ServerConfig, ready_pipe) -> None:
    """Entry point of the controller process (multiprocessing spawn)."""
    logging.basicConfig(
        level=config.args.log_level.upper(), format="%(asctime)s [dp-controller] %(levelname)s %(message)s"
    )
    exit_when_parent_dies()
    controller = Controller(config, zmq.Context())
    freeze_heap("data-parallel controller")
    ready_pipe.send({"ok": True})
    logger.info("routing to %d replicas (%s)", controller.replicas, config.args.load_balance_method)
    controller.run()
