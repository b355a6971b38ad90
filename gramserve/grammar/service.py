"""GrammarService: compiles constraints off the hot path and keeps one matcher per constrained request.

Compiles run on worker threads (the backends release the GIL), so mask filling for running requests
never waits behind a compile; outlines-core compiles (the slow ones) run in worker processes instead
(``compile_process``), which also keep a persistent cache on disk (``disk_cache``). A compile that outlives
its timeout (counted from when it starts running) is answered with an error at once. A worker process running
it is killed (and replaced); a thread cannot be, so its late result is discarded and the thread pool is
replaced, so later compiles never queue behind a runaway one.

One compile per grammar: results are cached by (backend, kind, text), failures in a negative cache, and a
request whose grammar is already compiling joins that compile (a *flight*) instead of starting another.

`auto` picks the backend by measured cost: it serves the requests with the first backend of ``AUTO_ORDER`` that
accepts the grammar (llguidance: about 1 ms to compile) as soon as it compiles. Then, in the background (a
*challenger* flight on a thread of its own that no request waits for), it measures what those masks cost to fill
(``fill_probe``); only above ``SWITCH_FILL_US`` does it compile the next backend too and measure both over a long
walk, and later requests for the grammar get the cheaper of the two. The choice is cached per (kind, text). A step's
mask rows are filled in batches per backend on ``fill_threads`` threads (see ``fill``); rows in one matcher state
are filled once (``shared_fills``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from gramserve.grammar.backends import BACKEND_NAMES, create_backend
from gramserve.grammar.backends.base import GrammarBackend, GrammarCompileError, GrammarOptions, Matcher
from gramserve.grammar.compile_process import (
    NOTHING_TO_RELAX,
    PROCESS_BACKENDS,
    BackendArgs,
    CompileResult,
    ProcessCompiler,
    audit_error,
    compile_grammar,
)
from gramserve.grammar.fill import FillPool, fill_rows
from gramserve.grammar.fill_probe import probe_fill_us
from gramserve.grammar.json_shape import JsonTokens
from gramserve.grammar.loop_guard import DigitTokens, LoopGuard
from gramserve.grammar.schema_checks import SchemaProblem
from gramserve.grammar.schema_relax import RELAXED, dropped_keywords, relaxable
from gramserve.grammar.shared_fills import StateKeys
from gramserve.grammar.surrogate_guard import SurrogateGuard
from gramserve.grammar.unique_arrays import unique_arrays
from gramserve.messages import GrammarCompileReq, GrammarCompileResp, GrammarRequest, GrammarStepReq, GrammarStepResp
from gramserve.sampling.bitmask import allocate_bitmask

logger = logging.getLogger(__name__)

# llguidance first: over the dev corpus it compiles in p50 1.1 ms / p99 1.7 ms (xgrammar: 10 / 247 ms) and fills
# as fast on unbounded fields, 2-4x faster on bounded strings and formats (docs/benchmarks.md, "Backend choice").
AUTO_ORDER = ("llguidance", "xgrammar", "outlines")
# `auto`'s last resort for a JSON schema no backend enforces exactly: llguidance over the closest schema it can
# enforce (schema_relax.py); the server checks such outputs and resamples failing ones.
NO_EXTENSION = "NoExtensionBias"  # llguidance's error where no token can extend the output
AUTO_RELAXED = "llguidance" + RELAXED
RELAXABLE_KINDS = ("json_schema", "structural_tag")  # a structural tag relaxes the JSON schemas inside it
# `auto`: a backend whose masks cost more than this (us per row, measured) makes the next backend worth a try.
SWITCH_FILL_US = 40.0
# The background comparison walks this far (bounded strings cost most at their later characters), within a budget.
LONG_PROBE_STEPS = 256
LONG_PROBE_MS = 150.0
# The challenger takes over only if clearly cheaper (probes of two backends over the same walk still vary).
SWITCH_MARGIN = 0.75
# Challengers run one at a time on their own thread, never ahead of compiles that requests wait for; when many new
# grammars arrive at once, the ones past this many waiting are not challenged.
MAX_CHALLENGERS = 8
# A challenger starts this long after its grammar's answer (seconds).
CHALLENGE_DELAY_S = 0.05
# Prefetched compiles that no request has joined yet, at most (more prefetches are dropped: they are only hints).
MAX_PREFETCHES = 8
# challenge_when_idle: a challenger starts once no step nor compile answer has come for this long (seconds).
IDLE_S = 0.5
# The kinds whose outputs the loop guard watches (JSON; a regex or EBNF may mean its repetitions).
LOOP_GUARDED_KINDS = ("json_schema", "json_object", "structural_tag")
SHAPE_WATCHED_KINDS = ("json_schema", "json_object")


@dataclass
class _Flight:
    """One grammar compiling for one or more requests."""

    key: tuple[str, str, str]  # (requested backend, kind, text)
    grammar: GrammarRequest
    candidates: list[str]  # backends still to try, in order
    rids: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    probes: dict[str, float] = field(default_factory=dict)  # backend -> measured fill us (auto)
    best: tuple[str, object] | None = None  # auto: the cheapest (backend, compiled) so far
    future: Future | None = None
    backend: str = ""
    started: float = 0.0
    in_process: bool = False  # compiling in a worker process (killable) rather than on a thread
    created: float = field(default_factory=time.monotonic)
    challenger: bool = False  # auto: measuring another backend in the background, for later requests
    prefetch: bool = False  # started before its first request arrived (GrammarPrefetchReq)

    @property
    def auto(self) -> bool:
        return self.key[0] in ("auto", "auto-challenger")


class LRU(OrderedDict):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def get_recent(self, key):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return None

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class GrammarService:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        options: GrammarOptions,
        bitmask: torch.Tensor,
        default_backend: str = "auto",
        compile_timeout_s: float = 5.0,
        cache_size: int = 512,
        compile_threads: int = 2,
        fill_threads: int = 1,
        compile_processes: bool = True,
        cache_dir: str = "",
        relax: bool = True,
        challenge_when_idle: bool = False,
        share_fills: bool = True,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.options = options
        self.bitmask = bitmask
        self.default_backend = default_backend
        self.compile_timeout_s = compile_timeout_s
        self.cache_dir = cache_dir
        self.relax = relax  # auto: serve schemas no backend enforces exactly through AUTO_RELAXED
        # Challengers wait until no step nor compile answer has come for IDLE_S: where the model's forward runs on
        # the CPU, a challenger beside it takes 0.4-0.9 s of CPU (2 threads) per grammar from it (docs/benchmarks.md).
        self.challenge_when_idle = challenge_when_idle
        self.last_active = 0.0  # time.monotonic() of the last step served or compile answered
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self.cache = LRU(cache_size)  # (backend, kind, text) -> compiled
        self.chosen = LRU(cache_size)  # auto: (kind, text) -> the backend it picked
        self.failures = LRU(cache_size)
        self.matchers: dict[str, Matcher] = {}
        self._unfilled: set[str] = set()  # requests whose matcher has not filled a mask yet
        self.loop_guards: dict[str, LoopGuard] = {}  # rid -> its guard (options.loop_guard, JSON kinds)
        # Rows in one matcher state fill once a step (shared_fills.py); None: every row fills.
        self.state_keys = StateKeys() if share_fills else None
        self.surrogates = SurrogateGuard.of(tokenizer)
        self._scratch: torch.Tensor | None = None  # one bitmask row for masks computed off the shared bitmask
        self.digit_tokens = DigitTokens.of(tokenizer) if options.loop_guard else None
        self.json_tokens = JsonTokens.of(tokenizer, vocab_size) if options.loop_guard else None
        self.pending: dict[tuple[str, str, str], _Flight] = {}  # compiles in flight, by key
        self._flight_of: dict[str, _Flight] = {}  # rid -> its flight
        self.compile_threads = compile_threads
        self.pool = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="grammar-compile")
        self.challenge_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-challenge")
        self.fill_pool = FillPool(fill_threads)  # resolved by server/settings.py (0: row by row)
        # Backends in PROCESS_BACKENDS compile in worker processes (made on first use) unless this is False.
        self.compile_processes = compile_processes
        self._compilers: dict[str, ProcessCompiler] = {}
        self.stats = {"compiled": 0, "cache_hits": 0, "shared": 0, "disk_hits": 0, "failed": 0, "timeouts": 0}
        self.stats["prefetched"] = 0  # compiles started before their first request (GrammarPrefetchReq)
        # Called (on the compiling thread) when a compile ends, so the worker's loop wakes for `poll_compiles` at
        # once instead of at its next poll.
        self.compile_done: Callable[[], None] | None = None
        self._background: list[Callable[[], None]] = []  # started once compiles' answers are out (start_background)
        self._unchallenged = LRU(64)  # auto: prefetched flights compiled before their request came, by key
        if default_backend != "auto":
            self.backend(default_backend)
            if self._in_process(default_backend):
                self._compiler(default_backend)  # start a worker now rather than on the first request
        else:
            self.backend(AUTO_ORDER[0])
            self.pool.submit(self.backend, AUTO_ORDER[1])  # the usual second choice, built off the hot path

    def backend(self, name: str) -> GrammarBackend:
        name = name.removesuffix(RELAXED)
        with self._backend_lock:
            if name not in self._backends:
                backend = create_backend(name, self.tokenizer, self.vocab_size, self.eos_token_ids, self.options)
                backend.fill_lanes = max(1, self.fill_pool.threads)
                self._backends[name] = backend
            return self._backends[name]

    # --- compiling --------------------------------------------------------------------------------

    def submit(self, req: GrammarCompileReq) -> GrammarCompileResp | None:
        """Start compiling, or join the compile of the same grammar in flight; returns a response at once on a
        cache hit or an invalid backend name."""
        g = req.grammar
        name = g.backend
        if name == "auto":
            candidates = list(AUTO_ORDER)
            if self.relax and g.kind in RELAXABLE_KINDS:
                candidates.append(AUTO_RELAXED)
            chosen = self.chosen.get_recent((g.kind, g.text))
            if chosen is not None:
                candidates = [chosen]
        elif name in BACKEND_NAMES:
            candidates = [name]
        elif req.rid is None:
            return None  # a prefetch: its request gets the error
        else:
            return GrammarCompileResp(
                req.rid, None, f"unknown grammar backend {name!r}; use one of {list(BACKEND_NAMES) + ['auto']}"
            )
        key = (name, g.kind, g.text)
        flight = self.pending.get(key)
        if req.rid is None:  # a prefetch: compile unless compiling or cached already; nobody is answered
            prefetching = sum(f.prefetch and not f.rids for f in self.pending.values())
            if flight is None and prefetching < MAX_PREFETCHES:
                self.stats["prefetched"] += 1
                self._try_next(_Flight(key, g, candidates, prefetch=True))
            return None
        if flight is not None:
            flight.rids.append(req.rid)
            self._flight_of[req.rid] = flight
            self.stats["shared"] += 1
            return None
        flight = _Flight(key, g, candidates, rids=[req.rid])
        out = self._try_next(flight)
        return out[0] if out else None

    def _try_next(self, f: _Flight) -> list[GrammarCompileResp]:
        """Start the flight's next candidate; the answers for its requests if it ended (hit, or none left)."""
        while f.candidates:
            backend = f.candidates.pop(0)
            key = (backend, f.grammar.kind, f.grammar.text)
            compiled = self.cache.get_recent(key)
            if compiled is not None and f.challenger:  # measured before, or asked for by name: no news
                return []
            if compiled is not None:
                self.stats["cache_hits"] += 1
                prefetched = self._unchallenged.pop(f.key, None) if f.rids else None
                if prefetched is not None:  # compiled before its request came: challenged now that it has one
                    self._background.append(lambda: self._challenge(prefetched))
                return self._finish(f, backend, compiled, 0.0, "cache")
            failure = self.failures.get_recent(key)
            if failure is None:
                failure = self._refused_at_once(backend, f.grammar)
            if failure is not None:
                if failure:
                    f.errors.append(f"{backend}: {failure}")
                continue
            f.backend, f.started = backend, time.monotonic()
            f.in_process = self._in_process(backend)
            if f.in_process:

                def started(f=f) -> None:  # the timeout counts from when a worker takes it
                    f.started = time.monotonic()

                f.future = self._compiler(backend).submit(f.grammar, on_start=started)
            else:
                pool = self.challenge_pool if f.challenger else self.pool
                f.future = pool.submit(self._timed_compile, f, backend, f.grammar)
            self.pending[f.key] = f
            for rid in f.rids:
                self._flight_of[rid] = f
            f.future.add_done_callback(self._compile_ended)
            return []
        if f.best is not None:  # auto: a later candidate failed, the earlier one stands
            return self._conclude(f, "compiled")
        self.stats["failed"] += 1
        error = "; ".join(f.errors) or "grammar rejected"
        return self._answer_all(f, lambda rid: GrammarCompileResp(rid, None, error))

    def _compile_ended(self, _future) -> None:
        if self.compile_done is not None:
            self.compile_done()

    def _refused_at_once(self, backend: str, grammar: GrammarRequest) -> str | None:
        """A refusal known without compiling: the audit of a backend that compiles in a worker process (no worker
        started for nothing), or a relaxed candidate with nothing to relax (its compile would repeat the exact one)."""
        if backend.endswith(RELAXED):
            return None if relaxable(grammar.text, grammar.kind) else ""
        if backend in PROCESS_BACKENDS:
            return audit_error(backend, grammar)
        return None

    def _timed_compile(self, f: _Flight, backend: str, grammar: GrammarRequest) -> CompileResult:
        f.started = time.monotonic()  # the timeout counts from the start of the work, not from the queue
        if not f.challenger:  # requests wait for this one: answer them as soon as it compiles
            relaxed = backend.endswith(RELAXED)
            return CompileResult(compile_grammar(self.backend(backend), grammar, relaxed), "compiled")
        incumbent, _ = f.best
        # Not while the grammar's first requests take their first tokens (their fills would wait for the GIL).
        time.sleep(CHALLENGE_DELAY_S)
        f.started = time.monotonic()
        # Probed on a compile of its own: matchers copied from one llguidance prototype share its lexer, and a walk
        # that ran it into a lexer limit would fail the requests it serves (a token its mask allowed then refused).
        served = self.backend(incumbent)
        incumbent_compiled = compile_grammar(served, grammar, incumbent.endswith(RELAXED))
        # A quick look first (a few ms): is the backend serving it cheap enough to stop at?
        quick_us = probe_fill_us(served, incumbent_compiled)
        if quick_us <= SWITCH_FILL_US:
            f.probes[incumbent] = round(quick_us, 2)
            return CompileResult(None, "skipped")
        while self.challenge_when_idle and time.monotonic() - self.last_active < IDLE_S:
            time.sleep(IDLE_S)
            f.started = time.monotonic()  # waiting is not compiling: the timeout starts after
        b = self.backend(backend)
        compiled = compile_grammar(b, grammar)
        # Both measured over the same long walk: short ones miss the costly states deep inside.
        fill_us = probe_fill_us(b, compiled, steps=LONG_PROBE_STEPS, budget_ms=LONG_PROBE_MS)
        f.probes[incumbent] = round(
            probe_fill_us(self.backend(incumbent), incumbent_compiled, LONG_PROBE_STEPS, LONG_PROBE_MS), 2
        )
        return CompileResult(compiled, "compiled", fill_us)

    def _in_process(self, backend: str) -> bool:
        if not self.compile_processes or backend not in PROCESS_BACKENDS:
            return False
        compiler = self._compilers.get(backend)
        if compiler is not None and compiler.broken:  # workers cannot start here: compile on threads
            return False
        return True

    def _compiler(self, backend: str) -> ProcessCompiler:
        compiler = self._compilers.get(backend)
        if compiler is None:
            args = BackendArgs(
                backend, self.tokenizer, self.vocab_size, list(self.eos_token_ids), self.options, self.cache_dir
            )
            compiler = self._compilers[backend] = ProcessCompiler(args, max_workers=self.compile_threads)
            # This process still makes the matchers: build its copy of the backend off the hot path.
            self.pool.submit(self.backend, backend)
        return compiler

    def _finish(self, f: _Flight, backend: str, compiled, ms: float, source: str) -> list[GrammarCompileResp]:
        """The flight succeeded with `backend`: a matcher per request."""
        if f.auto:
            self.chosen.put((f.grammar.kind, f.grammar.text), backend)
            if f.challenger:
                logger.info(
                    "grammar %s: auto serves it with %s from now on (fill us per row: %s)",
                    describe(f.grammar),
                    backend,
                    f.probes,
                )
        return self._answer_all(f, lambda rid: self._ready(rid, f.grammar, backend, compiled, ms, source, f.probes))

    def _answer_all(self, f: _Flight, answer) -> list[GrammarCompileResp]:
        self.pending.pop(f.key, None)
        if f.rids:  # requests about to run (prefill first: no steps yet)
            self.last_active = time.monotonic()
        out = []
        for i, rid in enumerate(f.rids):
            self._flight_of.pop(rid, None)
            resp = answer(rid)
            if i > 0 and resp.backend is not None:
                resp.source = "shared"
            out.append(resp)
        return out

    def _ready(
        self, rid: str, grammar: GrammarRequest, backend: str, compiled, ms: float, source: str, probes: dict
    ) -> GrammarCompileResp:
        try:
            self.matchers[rid] = self.backend(backend).matcher(compiled)
            self._unfilled.add(rid)
            self.surrogates.forget(rid)
            if self.state_keys is not None:
                self.state_keys.start(rid, (backend, grammar.kind, grammar.text))
            if self.options.loop_guard and grammar.kind in LOOP_GUARDED_KINDS:
                # the JSON's shape is followed in whole-JSON outputs (a tool-call grammar has free text around)
                shape = self.json_tokens if grammar.kind in SHAPE_WATCHED_KINDS else None
                unique = unique_arrays(grammar.text) if grammar.kind == "json_schema" else None
                self.loop_guards[rid] = LoopGuard(self.digit_tokens, shape, unique)
        except Exception as exc:  # noqa: BLE001 - a backend bug must not take the process down
            logger.exception("matcher creation failed")
            return GrammarCompileResp(rid, None, f"{backend}: cannot create a matcher: {exc}")
        return GrammarCompileResp(rid, backend, None, ms, source, dict(probes))

    def poll_compiles(self, start_background: bool = True) -> list[GrammarCompileResp]:
        """Collect finished (or timed-out) compiles. Their background work waits for `start_background`; what earlier
        calls left starts now, unless the caller is about to fill masks (`start_background=False`)."""
        if start_background:
            self.start_background()
        out = []
        now = time.monotonic()
        for f in list(self.pending.values()):
            if self.pending.get(f.key) is not f:
                continue  # dropped while this loop ran (a challenger pool replaced)
            fut = f.future
            key = (f.backend, f.grammar.kind, f.grammar.text)
            if fut.done():
                del self.pending[f.key]
                try:
                    result: CompileResult = fut.result()
                except SchemaProblem as exc:  # no backend can serve it: the other candidates are not tried
                    self.failures.put(key, str(exc))
                    f.candidates.clear()
                    f.errors = [str(exc)]
                except GrammarCompileError as exc:
                    self.failures.put(key, str(exc))
                    if str(exc) != NOTHING_TO_RELAX:  # the exact candidates' errors already say why
                        f.errors.append(f"{f.backend}: {exc}")
                except BaseException as exc:  # noqa: BLE001 - includes Rust panics surfacing as BaseException
                    if f.in_process and self._compilers[f.backend].broken:  # no worker: compile on a thread
                        f.candidates.insert(0, f.backend)
                        out.extend(self._try_next(f))
                        continue
                    logger.exception("grammar backend %s crashed while compiling", f.backend)
                    self.failures.put(key, f"backend error: {type(exc).__name__}: {exc}")
                    f.errors.append(f"{f.backend}: backend error: {exc}")
                else:
                    out.extend(self._compiled(f, result))
                    continue
                out.extend(self._try_next(f))
            elif fut.running() and now - f.started > self.compile_timeout_s:
                del self.pending[f.key]
                self.stats["timeouts"] += 1
                msg = f"compiling the grammar took longer than the {self.compile_timeout_s:g} s limit"
                self.failures.put(key, msg)
                logger.warning("grammar %s: %s (%s)", describe(f.grammar), msg, f.backend)
                if f.in_process:
                    self._compilers[f.backend].kill(fut)  # a fresh worker takes its place
                elif f.challenger:
                    self.challenge_pool.shutdown(wait=False, cancel_futures=True)
                    self.challenge_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-challenge")
                    self._drop_cancelled_challengers()
                else:
                    # A thread cannot be stopped: it finishes in the background and its result is dropped.
                    # New compiles go to a fresh pool so they never queue behind it.
                    self._abandon_pool()
                if f.best is not None:
                    out.extend(self._conclude(f, "compiled"))
                else:
                    out.extend(self._answer_all(f, lambda rid: GrammarCompileResp(rid, None, f"{f.backend}: {msg}")))
        return out

    def _compiled(self, f: _Flight, result: CompileResult) -> list[GrammarCompileResp]:
        """A candidate compiled: cache it and answer its requests; a new grammar under auto gets a challenger."""
        if result.compiled is None:  # a challenger that found the incumbent cheap enough: nothing changes
            return []
        self.cache.put((f.backend, f.grammar.kind, f.grammar.text), result.compiled)
        self.stats["disk_hits" if result.source == "disk" else "compiled"] += 1
        backend = self.backend(f.backend)
        if backend.fill_lanes > 1:  # after the answer, not before: a new grammar's first request waits for one compile
            self._background.append(lambda: self.pool.submit(_add_lanes, backend, result.compiled))
        if result.fill_us is not None:
            f.probes[f.backend] = round(result.fill_us, 2)
        margin = SWITCH_MARGIN if f.challenger else 1.0
        if f.best is None or f.probes.get(f.backend, 0.0) < margin * f.probes.get(f.best[0], float("inf")):
            f.best = (f.backend, result.compiled)
        out = self._conclude(f, result.source)
        if not f.challenger and f.auto and result.source == "compiled" and self._others_left(f):
            if f.rids:
                self._background.append(lambda: self._challenge(f))
            elif f.prefetch:  # its request has not come yet (and may never: a request can fail after its prefetch)
                self._unchallenged.put(f.key, f)
        return out

    def start_background(self) -> None:
        """Start the work that compiles queued for after their answers (fill lanes, challengers): those threads
        contend for the GIL and the cores, so the worker sends the answers first (a new grammar's first token waits
        for them), then calls this. `poll_compiles` also starts what an earlier call left."""
        work, self._background = self._background, []
        for start in work:
            start()

    def _challenge(self, f: _Flight) -> None:
        """Measure the served backend's fills in the background and, if costly, compile and measure the next one;
        `_finish` records the cheaper as the choice."""
        key = ("auto-challenger", f.grammar.kind, f.grammar.text)
        if key in self.pending or sum(p.challenger for p in self.pending.values()) >= MAX_CHALLENGERS:
            return
        others = [b for b in f.candidates if b not in PROCESS_BACKENDS and not b.endswith(RELAXED)]
        challenger = _Flight(key, f.grammar, others, probes=dict(f.probes), best=f.best, challenger=True)
        self._try_next(challenger)  # a cache hit ends it at once; nothing waits for its answers

    @staticmethod
    def _others_left(f: _Flight) -> bool:
        """Is there another backend worth measuring? (outlines-core, the slow-compiling last resort, is not.)"""
        return any(b not in PROCESS_BACKENDS and not b.endswith(RELAXED) for b in f.candidates)

    def _conclude(self, f: _Flight, source: str) -> list[GrammarCompileResp]:
        """Serve the flight's requests with its best backend; one log line per grammar compiled."""
        backend, compiled = f.best
        ms = (time.monotonic() - f.created) * 1e3
        if f.challenger:
            pass  # _finish logs the choice
        elif source == "disk":
            logger.info("grammar %s loaded by %s from the disk cache in %.1f ms", describe(f.grammar), backend, ms)
        else:
            probes = ", ".join(f"{b} {us:.1f}" for b, us in f.probes.items())
            logger.info(
                "grammar %s compiled by %s in %.1f ms%s%s",
                describe(f.grammar),
                backend,
                ms,
                f" (fill us per row: {probes})" if probes else "",
                f" for {len(f.rids)} requests" if len(f.rids) > 1 else "",
            )
        if backend.endswith(RELAXED):
            dropped = dropped_keywords(f.grammar.text, f.grammar.kind)
            logger.info(
                "grammar %s: no backend enforces it exactly; served relaxed (outputs checked and resampled), "
                "without %s",
                describe(f.grammar),
                "; ".join(dropped[:8]) + (f" and {len(dropped) - 8} more" if len(dropped) > 8 else ""),
            )
        return self._finish(f, backend, compiled, ms, source)

    def _abandon_pool(self) -> None:
        old = self.pool
        self.pool = ThreadPoolExecutor(max_workers=self.compile_threads, thread_name_prefix="grammar-compile")
        # Compiles still queued on the old pool move over: resubmit them (the running one stays behind).
        for f in self.pending.values():
            if not f.in_process and not f.challenger and f.future is not None and f.future.cancel():
                f.started = time.monotonic()
                f.future = self.pool.submit(self._timed_compile, f, f.backend, f.grammar)
                f.future.add_done_callback(self._compile_ended)
        old.shutdown(wait=False)

    def _drop_cancelled_challengers(self) -> None:
        for key, f in list(self.pending.items()):
            if f.challenger and f.future is not None and f.future.cancelled():
                del self.pending[key]

    @property
    def awaited(self) -> bool:
        """Is a compile in flight that requests wait for? (Challengers: nobody waits.)"""
        return any(not f.challenger for f in self.pending.values())

    def flight_of(self, rid: str) -> _Flight | None:
        """The compile the request waits for, if any."""
        return self._flight_of.get(rid)

    def abort(self, rid: str) -> None:
        """Drop the request's matcher; a compile it waits for goes on for the others (and the cache)."""
        f = self._flight_of.pop(rid, None)
        if f is not None and rid in f.rids:
            f.rids.remove(rid)
            if not f.rids and self.pending.get(f.key) is f:
                self._drop_abandoned(f)
        self.matchers.pop(rid, None)
        self._unfilled.discard(rid)
        self.loop_guards.pop(rid, None)
        self.surrogates.forget(rid)
        if self.state_keys is not None:
            self.state_keys.forget(rid)

    def _drop_abandoned(self, f: _Flight) -> None:
        """No request waits for this compile any more (their clients left): one still queued never runs, and one in
        a compile process is killed; one on a thread cannot be stopped and finishes for the cache. (A new user sent
        schemas that compile for seconds and left at once: each compiled, then was challenged, while others waited.)"""
        fut = f.future
        if fut is None or fut.done():
            return
        if fut.cancel():
            del self.pending[f.key]
        elif f.in_process:
            del self.pending[f.key]
            self._compilers[f.backend].kill(fut)

    def close(self) -> None:
        """Stop the compile workers and threads (running compile threads finish in the background)."""
        for compiler in self._compilers.values():
            compiler.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.challenge_pool.shutdown(wait=False, cancel_futures=True)

    # --- stepping -----------------------------------------------------------------------------

    def step(self, req: GrammarStepReq) -> GrammarStepResp:
        t0 = time.perf_counter()
        self.last_active = time.monotonic()
        rejected, failed = [], {}
        for rid in req.free:
            self.abort(rid)
        guards, keys = self.loop_guards, self.state_keys
        for rid, token in req.accept:
            m = self.matchers.get(rid)
            if m is None or not m.accept_token(token):
                # A backend limit hit while the token was checked fails the request as too complex (a 400), as one
                # hit while filling does; any other refusal is an internal error.
                if m is not None and (why := self._limit_hit(m)):
                    failed[rid] = why
                else:
                    rejected.append(rid)
                if keys is not None:
                    keys.forget(rid)
                continue
            self.surrogates.accept(rid, token)
            if (guard := guards.get(rid)) is not None:
                guard.accept(token)
            if keys is not None:
                keys.accept(rid, token)
        rows, rids = [], []
        for rid, row in req.fill:
            m = self.matchers.get(rid)
            if m is None:
                self.bitmask[row].fill_(-1)  # unknown request: leave it unconstrained rather than all-masked
                rejected.append(rid)
                continue
            rows.append((m, row))
            rids.append(rid)
        filled, copies = keys.split(rids) if keys is not None and len(rids) > 1 else (range(len(rids)), [])
        loop_bans = self._fill([(rids[i], rows[i]) for i in filled])
        if copies:
            # A row whose first fill failed (a backend limit) is not copied: each matcher meets the failure itself.
            again = []
            for i, j in copies:
                leader, leader_row = rows[j]
                if leader.error():
                    again.append((rids[i], rows[i]))
                    continue
                self.bitmask[rows[i][1]].copy_(self.bitmask[leader_row])
                if (guard := self.loop_guards.get(rids[i])) is not None:
                    guard.banned()  # its bookkeeping (bans it remembers, items being copied) as the filled row's
            loop_bans += self._fill(again)
        failed.update((rid, why) for rid, (m, _) in zip(rids, rows) if (why := m.error()))
        empty = []
        # A grammar that allows no first token accepts nothing: a 400, not a token it then refuses (a 500).
        if self._unfilled and (fresh := self._unfilled.intersection(rids)):
            self._unfilled -= fresh
            for rid, (_, row) in zip(rids, rows):
                if rid in fresh:
                    # llguidance stops with "NoExtensionBias" where no token can extend the empty output
                    stopped = NO_EXTENSION in failed.get(rid, "")
                    if stopped or (rid not in failed and not self.bitmask[row].any()):
                        failed.pop(rid, None)
                        empty.append(rid)
        ms = (time.perf_counter() - t0) * 1e3
        return GrammarStepResp(
            req.step, rejected, ms, failed=failed, loop_bans=loop_bans, shared_fills=len(copies), empty=empty
        )

    def _limit_hit(self, m: Matcher) -> str | None:
        """Why a matcher that refused a token is past a backend limit, or None. llguidance's token check can refuse
        a token on a limit without entering its error state (a mask computation does), so one is computed here."""
        if (why := m.error()) is not None:
            return why
        if self._scratch is None:
            self._scratch = allocate_bitmask(1, self.vocab_size)
        try:
            m.fill_bitmask(self._scratch, 0)
        except Exception:  # noqa: BLE001 - the refusal stands as it was
            return None
        return m.error()

    def _fill(self, items: list[tuple[str, tuple[Matcher, int]]]) -> int:
        """Fill these (rid, (matcher, row)) rows and narrow them by their loop guards; returns the rows narrowed."""
        if not items:
            return 0
        fill_rows([mr for _, mr in items], self.bitmask, self.fill_pool)
        if pending := self.surrogates.pending:
            for rid, (_, row) in items:
                if rid in pending:
                    ban_tokens(self.bitmask[row], self.surrogates.completes)
        guards = self.loop_guards
        if not guards:
            return 0
        loop_bans = 0
        for rid, (_, row) in items:
            guard = guards.get(rid)
            if guard is None:
                continue
            if banned := guard.banned():
                loop_bans += ban_tokens(self.bitmask[row], banned)
            keep, drop = guard.narrowing()
            if keep is not None:
                loop_bans += keep_only(self.bitmask[row], keep)
            if drop is not None:
                loop_bans += drop_tokens(self.bitmask[row], drop)
        return loop_bans


def _add_lanes(backend: GrammarBackend, compiled) -> None:
    try:
        backend.add_lanes(compiled)
    except Exception:  # noqa: BLE001 - the grammar is served from the lanes it has
        logger.exception("%s: could not add fill lanes", backend.name)


def ban_tokens(row: torch.Tensor, tokens: set[int] | frozenset[int]) -> int:
    """Clear `tokens` from one int32 bitmask row unless that would leave no token allowed; 1 if any was cleared.
    Only the words that hold them are read and written (a row is 1.5-4k words; a ban hits a few), and the whole row
    is scanned only when those words end up empty."""
    words = row.numpy().view(np.uint32)
    before: dict[int, int] = {}
    for t in tokens:
        w = t >> 5
        if w < words.shape[0]:
            v = int(words[w])
            before.setdefault(w, v)
            words[w] = v & ~(1 << (t & 31))
    after = {w: int(words[w]) for w in before}
    if after == before:
        return 0
    if not any(after.values()) and not words.any():
        for w, v in before.items():  # every allowed token continues the loop: the grammar decides
            words[w] = v
        return 0
    return 1


def keep_only(row: torch.Tensor, allowed: np.ndarray) -> int:
    """Narrow one int32 bitmask row to the `allowed` bits, unless none of them is allowed there; 1 if narrowed."""
    words = row.numpy().view(np.uint32)
    n = min(words.shape[0], allowed.shape[0])
    narrowed = words[:n] & allowed[:n]
    if not narrowed.any():
        return 0  # the grammar allows no closing token here (a minLength, a pattern): it decides
    words[:n] = narrowed
    words[n:] = 0
    return 1


def drop_tokens(row: torch.Tensor, dropped: np.ndarray) -> int:
    """Clear the `dropped` bits from one int32 bitmask row, unless no token would be left; 1 if any was cleared."""
    words = row.numpy().view(np.uint32)
    n = min(words.shape[0], dropped.shape[0])
    hit = words[:n] & dropped[:n]
    if not hit.any():
        return 0
    left = words[:n] & ~dropped[:n]
    if not left.any() and not words[n:].any():
        return 0  # every allowed token ends the item with a comma: the grammar decides
    words[:n] = left
    return 1


def describe(grammar: GrammarRequest) -> str:
    """A short name for a grammar in log lines: its kind, size and a hash of its text."""
    digest = hashlib.sha256(grammar.text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{grammar.kind}:{digest} ({len(grammar.text)} B)"
