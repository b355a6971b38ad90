"""The scheduler's side of the grammar workers: which worker serves which request, and the step messages.

There are `Settings.grammar_shards` grammar workers. Each constrained request is given to one of them (its
*shard*: one that had the same grammar lately unless it holds more than AFFINITY_SLACK live requests more than the
lightest, else the lightest) when its compile is asked for; that worker keeps its matcher until `free`. Each
constrained request also owns one bitmask row (its *slot*, `grammar_slots.SlotTable`) while it runs. A grammar step
asks every shard with work in it to accept tokens and fill slots; `wait` collects the answers (each shard answers in
step order) before the scheduler applies the masks (`sampling/grammar_masks.py`).

Two ways a slot gets its next mask:
* a fill asked for by the scheduler (`begin_step`), with the accepts the scheduler queued: the plain schedule
  (asked before the forward), and under overlap for rows without a fresh mask (a new request, a grammar that
  just started);
* under overlap, eagerly: `announce_feed` tells the shards, before the step samples, which ids of the step
  will come through the token feed (`grammar/token_feed.py`, which describes the protocol) and which slots to
  refill with them; `publish_feed` queues the ids into the feed right after sampling. The grammar workers accept
  them and refill at once: the mask for the next step exists before the scheduler has even read the ids itself.

In steady decode the constrained rows are the same from step to step. The client then remembers the last fed
layout (`token_feed.FedLayout`): the next step's masks come without per-row work, and each shard is told to reuse
its rows of the last fed step (`GrammarStepReq.repeat_fed`) instead of being sent them again.

Compile results arrive asynchronously and are collected with `poll_compiles`. A request whose grammar its shard
compiled lately (`compile` returns True) need not wait for the answer: the shard answers it from its compile cache
as soon as it reads the request, before any step message sent after it (each shard reads its inbox in order), so
the scheduler admits it at once instead of a step later. Should the shard have dropped the grammar from its cache
meanwhile, it finishes the compile before it fills that request's row (`grammar/worker.py`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

import torch
import zmq

from gramserve.config import ServerConfig
from gramserve.grammar.grammar_shm import attach_grammar_shm, page_lock, page_unlock
from gramserve.grammar.token_feed import FedLayout, FeedWriter
from gramserve.histogram import Histogram
from gramserve.ipc import SCHEDULER_GRAMMAR_IN, grammar_inbox, pull_socket, push_socket
from gramserve.messages import GrammarCompileReq, GrammarCompileResp, GrammarRequest, GrammarStepReq, GrammarStepResp
from gramserve.scheduler.grammar_slots import SlotTable

logger = logging.getLogger(__name__)

STEP_TIMEOUT_MS = 60_000
BUSY_POLL_MS = 20.0  # with busy_poll: how long either side polls without sleeping before it blocks
# A request goes to a shard that had its grammar lately while that shard holds at most this many live requests more
# than the lightest: a compile (1-10 ms, once) costs less than rows that make one shard's fill the step's slowest
# for as long as they run.
AFFINITY_SLACK = 2
RECENT_GRAMMARS = 512  # per shard: grammars remembered as compiled there (its compile cache holds as many)


# One shard's rows of a step: (rid, slot) to fill, (rid, position) whose ids come through the token feed.
ShardRows = tuple[list[tuple[str, int]], list[tuple[str, int]]]


class GrammarWorkerError(RuntimeError):
    pass


class GrammarClient:
    def __init__(self, config: ServerConfig, ctx: zmq.Context):
        launch = config.launch
        self.shards = config.settings.grammar_shards
        self.to_grammar = [push_socket(ctx, launch.replica_path(grammar_inbox(i))) for i in range(self.shards)]
        self.inbox = pull_socket(ctx, launch.replica_path(SCHEDULER_GRAMMAR_IN))
        self._shared = attach_grammar_shm(launch.grammar_shm, config.settings.max_running_requests, launch.vocab_size)
        self.bitmask = self._shared.bitmask
        self._step = 0  # the last step number given out
        self._unanswered: list[deque[int]] = [deque() for _ in range(self.shards)]  # steps sent, per shard
        self._shard_of: dict[str, int] = {}  # rid -> shard, from its compile until `free`
        self._load = [0] * self.shards  # live requests per shard
        self.placed = [0] * self.shards  # requests given to each shard so far (/get_server_info)
        # Per shard: hashes of the grammars given to it lately (a hint for placement: a collision only moves a request).
        self._recent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.shards)]
        # Per shard: hashes of the grammars it compiled successfully lately (answers seen), and the hash each request
        # waits on until its answer comes.
        self._compiled_ok: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.shards)]
        self._key_of: dict[str, int] = {}
        self._accept: list[list[tuple[str, int]]] = [[] for _ in range(self.shards)]
        self._free: list[list[str]] = [[] for _ in range(self.shards)]
        self._compiled: list[GrammarCompileResp] = []
        self._rejected: dict[str, tuple[str, int]] = {}  # rid -> why its grammar failed it, and the HTTP status
        self._slots = SlotTable(self.bitmask.shape[0])
        self._layout: FedLayout | None = None
        self._feed: FeedWriter | None = None
        self._pinned = False
        # Poll for replies without sleeping (the scheduler sets it on a GPU, where the step is short and cores
        # are many): a round trip through a blocked process cost ~0.7 ms more on the H100 host (docs/benchmarks.md).
        self.busy_poll = False
        # Where constrained steps spend the scheduler's time (ms, cumulative; /get_server_info shows them).
        # steps: grammar steps sent (to one shard or more); fed_steps: those whose tokens came through the token
        # feed, repeated_fed_steps: those that reused the last fed step's rows; replies: the shards' answers;
        # fill_ms: accept + fill time in the grammar workers, summed over shards; apply_ms: masking the logits
        # (the scheduler's MaskApplier; the scheduler adds it here); loop_bans: rows whose mask the loop guard
        # narrowed (grammar/loop_guard.py); stale_slot_waits: fills held back until a reused slot's last fed fill
        # landed (grammar_slots.py); shared_fills: rows that copied the mask of a row in the same matcher state
        # (grammar/shared_fills.py).
        self.timing = {
            "steps": 0,
            "fed_steps": 0,
            "repeated_fed_steps": 0,
            "replies": 0,
            "wait_after_forward_ms": 0.0,
            "apply_ms": 0.0,
            "fill_ms": 0.0,
            "loop_bans": 0,
            "stale_slot_waits": 0,
            "shared_fills": 0,
        }
        # Compile answers by source (messages.GrammarCompileResp.source; "failed": no backend took it) and by the
        # backend that serves them; the time of each compile that ran (or disk load); each shard reply's fill time.
        self.compiles = {"compiled": 0, "shared": 0, "cache": 0, "disk": 0, "failed": 0}
        self.admitted_early = 0  # requests run before their compile answer (compile() returned True)
        self.prefetched = 0  # compiles started ahead of their request (prefetch)
        self.backends: dict[str, int] = {}
        self.compile_hist = Histogram()
        self.fill_hist = Histogram()

    def report(self) -> dict:
        """The grammar side of /get_server_info."""
        return {
            "grammar_timing": dict(self.timing),
            "grammar_compiles": {**self.compiles, "backends": dict(self.backends)},
            "grammar_compile_ms": self.compile_hist.report(),
            "grammar_fill_ms_per_reply": self.fill_hist.report(),
            "grammar_slots_in_use": self.slots_in_use,
            "grammar_requests_per_shard": list(self.placed),
            "grammar_live_requests": self.live_requests,
            "grammar_admitted_early": self.admitted_early,
            "grammar_prefetched": self.prefetched,
        }

    def attach(self, device: torch.device, use_feed: bool) -> None:
        """Bind to the scheduler's device, before anything copies masks out of the shared memory or ids into it;
        `use_feed` turns the token feed on."""
        cuda = device.type == "cuda"
        self.busy_poll = cuda
        # On CUDA the whole segment is page-locked once: the GPU copies masks out of it and ids into it.
        pinned = self._pinned = cuda and page_lock(self._shared.segment)
        if use_feed and (pinned or not cuda):
            self._feed = FeedWriter(self._shared.feed, device)
        elif use_feed:
            logger.warning("the token feed needs page-locked shared memory; grammar tokens go through the scheduler")

    def close(self) -> None:
        """Unregister the shared memory from CUDA (needed before it is unmapped, if the process goes on)."""
        if self._pinned:
            torch.cuda.synchronize()
            page_unlock(self._shared.segment)
            self._pinned = False

    def stop_feed(self) -> None:
        """Send accepts through the scheduler from now on (benchmarks compare both ways)."""
        self._feed = None
        self._slots.clear_fed()
        self._layout = None

    @property
    def pinned(self) -> bool:
        """The shared segment is page-locked (CUDA, after `attach`): masks are copied to the GPU straight out of it."""
        return self._pinned

    @property
    def feeding(self) -> bool:
        return self._feed is not None

    @property
    def slots_in_use(self) -> int:
        return self._slots.in_use

    # --- compiles and request lifetime ------------------------------------------------------------

    def compile(self, rid: str, grammar: GrammarRequest) -> bool:
        """Give the request to a shard and have that shard compile its grammar. True if that shard compiled this
        grammar successfully lately: the request may run before the answer comes (see the module docstring)."""
        key = hash((grammar.backend, grammar.kind, grammar.text))
        shard = self._pick_shard(key)
        self._shard_of[rid] = shard
        self._key_of[rid] = key
        self._load[shard] += 1
        self.placed[shard] += 1
        self.to_grammar[shard].send_pyobj(GrammarCompileReq(rid, grammar))
        early = key in self._compiled_ok[shard]
        self.admitted_early += early
        return early

    def prefetch(self, grammar: GrammarRequest) -> None:
        """Start compiling a grammar whose request is on its way (GrammarPrefetchReq). The shard that gets it is
        remembered as having it, so the request goes there and joins the compile (or finds it cached)."""
        key = hash((grammar.backend, grammar.kind, grammar.text))
        if any(key in recent for recent in self._recent):
            return  # a shard had it lately: the request goes there anyway
        self.to_grammar[self._pick_shard(key)].send_pyobj(GrammarCompileReq(None, grammar))
        self.prefetched += 1

    def _pick_shard(self, key: int) -> int:
        """A shard that had this grammar lately (its compile cache likely holds it: no compile, and the request may
        run before the answer) unless it holds more than AFFINITY_SLACK more live requests than the lightest shard;
        else the lightest (among equals, one that had it). Once every shard had it, the lightest."""
        load = self._load
        lightest = min(range(self.shards), key=lambda i: (load[i], key not in self._recent[i], i))
        had = [i for i in range(self.shards) if key in self._recent[i]]
        shard = lightest
        if had and lightest not in had:
            best = min(had, key=lambda i: load[i])
            if load[best] <= load[lightest] + AFFINITY_SLACK:
                shard = best
        _remember(self._recent[shard], key)
        return shard

    @property
    def live_requests(self) -> int:
        """Requests whose matcher a grammar worker holds (compiled or compiling, not yet freed)."""
        return len(self._shard_of)

    @property
    def has_answers(self) -> bool:
        """Compile answers already read off the socket (while waiting for a step's masks) and not yet polled."""
        return bool(self._compiled)

    def poll_compiles(self) -> list[GrammarCompileResp]:
        while self._receive(block=False):
            pass
        out, self._compiled = self._compiled, []
        return out

    def release_slot(self, rid: str) -> None:
        """The request stopped running (finished or retracted): its row may go to another request."""
        if self._slots.release(rid):
            self._layout = None

    def free(self, rid: str) -> None:
        """The request is done: drop its matcher."""
        self.release_slot(rid)
        self._rejected.pop(rid, None)
        self._key_of.pop(rid, None)
        shard = self._shard_of.pop(rid, None)
        if shard is not None:  # None: never compiled (it failed before)
            self._load[shard] -= 1
            self._free[shard].append(rid)

    # --- steps ----------------------------------------------------------------------------------

    def accept(self, rid: str, token: int) -> None:
        self._accept[self._shard_of.get(rid, 0)].append((rid, token))

    def masks_for(self, rows: list[int], rids: list[str]) -> tuple[list[tuple[int, int]], int]:
        """For logits rows `rows` of requests `rids`: the (row, slot) pairs to apply and the grammar step to wait
        for. A request takes its slot (bitmask row) here on first use and keeps it until `release_slot`. One whose
        slot the token feed is refilling waits for that fill; the others are asked for now (`begin_step`). This
        runs every step for every constrained row: when the rows are those of the last fed step, the answer is the
        layout's, with no per-row work."""
        lay = self._layout
        if lay is not None and rids == lay.rids:
            return lay.pairs_for(rows), lay.step
        pairs, fill, step, stale = self._slots.take(rows, rids)
        if stale and not self._answered(stale):
            # A slot taken here may still be written by its last owner's fed fill (grammar_slots.py): that fill
            # must land before this one is asked, whichever shard each is on.
            self.timing["stale_slot_waits"] += 1
            self.wait(stale)
        if fill:
            step = max(step, self.begin_step(fill))
        return pairs, step

    def begin_step(self, fill: list[tuple[str, int]]) -> int:
        """Send the queued accepts and frees, and ask for `fill` ((rid, slot) pairs); returns the step."""
        if self.shards == 1:
            return self._send([(fill, [])])
        parts = [([], []) for _ in range(self.shards)]
        shard_of = self._shard_of
        for rid, slot in fill:
            parts[shard_of.get(rid, 0)][0].append((rid, slot))
        return self._send(parts)

    def _send(self, parts: list[ShardRows] | None, repeat: list[int] = ()) -> int:
        """Step `self._step + 1`: parts[shard] = (fill, fed) rows of that shard; shards in `repeat` reuse their rows
        of the last fed step. Each shard with rows or with queued accepts or frees gets its `GrammarStepReq`."""
        self._step += 1
        busy_poll_ms = BUSY_POLL_MS if self.busy_poll else 0.0
        sent = False
        for shard in range(self.shards):
            shard_fill, shard_fed = parts[shard] if parts is not None else ([], [])
            accept, free = self._accept[shard], self._free[shard]
            repeat_fed = shard in repeat
            if not (accept or free or shard_fill or shard_fed or repeat_fed):
                continue
            self.to_grammar[shard].send_pyobj(
                GrammarStepReq(self._step, accept, shard_fill, free, busy_poll_ms, shard_fed, repeat_fed)
            )
            self._accept[shard], self._free[shard] = [], []
            self._unanswered[shard].append(self._step)
            sent = True
        self.timing["steps"] += sent
        return self._step

    def announce_feed(self, n: int, positions: list[int], rids: list[str]) -> int | None:
        """Overlap, before a step samples its `n` ids: the constrained requests `rids` (at `positions` of those ids)
        will have their ids in the token feed (`publish_feed`); each shard accepts them and refills those
        requests' slots as soon as they land. Returns the step to publish, 0 if there is nothing to feed, None if
        the feed cannot take them (the caller queues the accepts itself)."""
        if not rids:
            return 0
        if self._feed is None or n > self._feed.rows:
            self._layout = None
            self._slots.forget_fed(rids)
            return None
        lay = self._layout
        if lay is not None and rids == lay.rids and positions == lay.positions:
            step = self._send(None, repeat=lay.shards)
            self.timing["repeated_fed_steps"] += 1
        else:
            slots = self._slots.slots_of(rids)
            parts = self._fed_parts(rids, positions, slots)
            step = self._send(parts)
            lay = self._layout = FedLayout(rids, positions, slots, [i for i, (fill, _) in enumerate(parts) if fill])
        lay.step = step
        self._slots.mark_fed(rids, step)
        self.timing["fed_steps"] += 1
        return step

    def _fed_parts(self, rids: list[str], positions: list[int], slots: list[int]) -> list[ShardRows]:
        """Per shard: the (rid, slot) rows to fill and the (rid, position) ids to take from the feed."""
        parts = [([], []) for _ in range(self.shards)]
        shard_of = self._shard_of
        for rid, pos, slot in zip(rids, positions, slots):
            fill, fed = parts[shard_of.get(rid, 0)]
            fill.append((rid, slot))
            fed.append((rid, pos))
        return parts

    def publish_feed(self, step: int, token_ids: torch.Tensor) -> None:
        """Queue a step's sampled ids (device tensor) into the token feed, after `announce_feed` gave `step`."""
        self._feed.publish(step, token_ids)

    def flush(self) -> None:
        """Send pending accepts / frees without waiting (their answer is collected by a later `wait`)."""
        if any(self._accept) or any(self._free):
            self.begin_step([])

    def _answered(self, step: int) -> bool:
        """Every shard has answered every step up to `step` that was sent to it."""
        return all(not q or q[0] > step for q in self._unanswered)

    def wait(self, step: int) -> None:
        """Wait until every step up to `step` is answered (each shard answers its steps in order)."""
        t0 = time.perf_counter()
        spin_until = time.monotonic() + BUSY_POLL_MS / 1e3 if self.busy_poll else 0.0
        while not self._answered(step):
            if time.monotonic() < spin_until:
                self._receive(block=False)
            elif not self._receive(block=True):
                raise GrammarWorkerError(f"no mask from the grammar worker for step {step}")
        self.timing["wait_after_forward_ms"] += (time.perf_counter() - t0) * 1e3

    def take_rejected(self, rids) -> dict[str, tuple[str, int]]:
        """Which of `rids` their grammar failed since last asked, with why and the status: a token refused (an
        internal error, 500), or the matcher past a backend limit (the grammar is too complex for it, 400)."""
        if not self._rejected:  # the normal case: no per-request work
            return {}
        return {rid: self._rejected.pop(rid) for rid in rids if rid in self._rejected}

    def _receive(self, block: bool) -> bool:
        """Handle one message; False if none came (within the step timeout when blocking)."""
        if block and not self.inbox.poll(STEP_TIMEOUT_MS):
            return False
        try:
            msg = self.inbox.recv_pyobj(0 if block else zmq.NOBLOCK)
        except zmq.Again:
            return False
        if isinstance(msg, GrammarCompileResp):
            self._count_compile(msg)
            self._compiled.append(msg)
        elif isinstance(msg, GrammarStepResp):
            self._on_step(msg)
        return True

    def _on_step(self, resp: GrammarStepResp) -> None:
        sent = self._unanswered[resp.shard]
        while sent and sent[0] <= resp.step:
            sent.popleft()
        # Answers about requests already freed (one failed by an earlier answer whose sampled token the worker then
        # refused through the feed) are dropped: nothing would ever take them.
        live = self._shard_of
        for rid in resp.empty:
            if rid in live:
                self._rejected.setdefault(rid, ("the grammar allows no output: no value satisfies it", 400))
        for rid, why in resp.failed.items():
            if rid in live:
                why = f"the grammar is too complex for its backend, which stopped: {why}"
                self._rejected.setdefault(rid, (why, 400))
        for rid in resp.rejected:
            if rid in live:
                self._rejected.setdefault(rid, ("the grammar rejected a token (internal error)", 500))
        self.timing["replies"] += 1
        self.timing["fill_ms"] += resp.fill_ms
        self.timing["loop_bans"] += resp.loop_bans
        self.timing["shared_fills"] += resp.shared_fills
        self.fill_hist.observe(resp.fill_ms)

    def _count_compile(self, resp: GrammarCompileResp) -> None:
        key, shard = self._key_of.pop(resp.rid, None), self._shard_of.get(resp.rid)
        if key is not None and shard is not None:
            if resp.backend is None:
                self._compiled_ok[shard].pop(key, None)
            else:
                _remember(self._compiled_ok[shard], key)
        if resp.backend is None:
            self.compiles["failed"] += 1
            return
        self.compiles[resp.source] = self.compiles.get(resp.source, 0) + 1
        self.backends[resp.backend] = self.backends.get(resp.backend, 0) + 1
        if resp.source in ("compiled", "disk"):
            self.compile_hist.observe(resp.compile_ms)


def _remember(lru: OrderedDict[int, None], key: int) -> None:
    """Put `key` last in a bounded recency list (RECENT_GRAMMARS, as many as a shard's compile cache holds)."""
    lru[key] = None
    lru.move_to_end(key)
    if len(lru) > RECENT_GRAMMARS:
        lru.popitem(last=False)
