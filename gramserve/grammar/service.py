"""GrammarService: compiles constraints off the hot path and keeps one matcher per constrained request.

Compiles run on worker threads (the backends release the GIL), so mask filling for running requests
never waits behind a compile. A compile that outlives its timeout (counted from when it starts running)
is answered with an error at once and its late result discarded; the pool is replaced, so later compiles
never queue behind a runaway one. Results are cached by (backend, kind, text), failures in a negative cache.
`auto` tries the backends in order and falls back to the next one when a backend rejects the grammar.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from gramserve.grammar.backends import BACKEND_NAMES, create_backend
from gramserve.grammar.schema_audit import unenforced
from gramserve.grammar.backends.base import GrammarBackend, GrammarCompileError, GrammarOptions, GrammarSpec, Matcher
from gramserve.messages import GrammarCompileReq, GrammarCompileResp, GrammarRequest, GrammarStepReq, GrammarStepResp

logger = logging.getLogger(__name__)

AUTO_ORDER = ("xgrammar", "llguidance", "outlines")


@dataclass
class _PendingCompile:
    rid: str
    grammar: GrammarRequest
    candidates: list[str]  # backends still to try, in order
    errors: list[str] = field(default_factory=list)
    future: Future | None = None
    backend: str = ""
    started: float = 0.0


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
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: GrammarOptions,
                 bitmask: torch.Tensor, default_backend: str = "xgrammar", compile_timeout_s: float = 5.0,
                 cache_size: int = 512, compile_threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.options = options
        self.bitmask = bitmask
        self.default_backend = default_backend
        self.compile_timeout_s = compile_timeout_s
        self._backends: dict[str, GrammarBackend] = {}
        self._backend_lock = threading.Lock()
        self.cache = LRU(cache_size)
        self.failures = LRU(cache_size)
        self.matchers: dict[str, Matcher] = {}
        self.pending: dict[str, _PendingCompile] = {}
        self.compile_threads = compile_threads
        self.pool = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="grammar-compile")
        self.stats = {"compiled": 0, "cache_hits": 0, "failed": 0, "timeouts": 0}
        if default_backend != "auto":
            self.backend(default_backend)
        else:
            self.backend(AUTO_ORDER[0])

    def backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                self._backends[name] = create_backend(name, self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                      self.options)
            return self._backends[name]

    # --- compiling --------------------------------------------------------------------------------

    def submit(self, req: GrammarCompileReq) -> GrammarCompileResp | None:
        """Start compiling; returns a response at once on a cache hit or an invalid backend name."""
        name = req.grammar.backend
        if name == "auto":
            candidates = list(AUTO_ORDER)
        elif name in BACKEND_NAMES:
            candidates = [name]
        else:
            return GrammarCompileResp(req.rid, None, f"unknown grammar backend {name!r}; use one of "
                                                     f"{list(BACKEND_NAMES) + ['auto']}")
        pending = _PendingCompile(req.rid, req.grammar, candidates)
        return self._try_next(pending)

    def _try_next(self, p: _PendingCompile) -> GrammarCompileResp | None:
        while p.candidates:
            backend = p.candidates.pop(0)
            key = (backend, p.grammar.kind, p.grammar.text)
            compiled = self.cache.get_recent(key)
            if compiled is not None:
                self.stats["cache_hits"] += 1
                return self._ready(p.rid, backend, compiled, 0.0)
            failure = self.failures.get_recent(key)
            if failure is not None:
                p.errors.append(f"{backend}: {failure}")
                continue
            p.backend, p.started = backend, time.monotonic()
            p.future = self.pool.submit(self._timed_compile, p, backend, p.grammar)
            self.pending[p.rid] = p
            return None
        self.stats["failed"] += 1
        return GrammarCompileResp(p.rid, None, "; ".join(p.errors) or "grammar rejected")

    def _timed_compile(self, p: _PendingCompile, backend: str, grammar: GrammarRequest):
        p.started = time.monotonic()  # the timeout counts from the start of the work, not from the queue
        return self._compile(backend, grammar)

    def _compile(self, backend: str, grammar: GrammarRequest):
        if grammar.kind == "json_schema":
            gaps = unenforced(backend, grammar.text)
            if gaps:
                raise GrammarCompileError(f"the schema uses {', '.join(gaps)}, which {backend} does not enforce")
        return self.backend(backend).compile(GrammarSpec(grammar.kind, grammar.text))

    def _ready(self, rid: str, backend: str, compiled, ms: float) -> GrammarCompileResp:
        try:
            self.matchers[rid] = self.backend(backend).matcher(compiled)
        except Exception as exc:  # noqa: BLE001 - a backend bug must not take the process down
            logger.exception("matcher creation failed")
            return GrammarCompileResp(rid, None, f"{backend}: cannot create a matcher: {exc}")
        return GrammarCompileResp(rid, backend, None, ms)

    def poll_compiles(self) -> list[GrammarCompileResp]:
        """Collect finished (or timed-out) compiles."""
        out = []
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            fut = p.future
            key = (p.backend, p.grammar.kind, p.grammar.text)
            if fut.done():
                del self.pending[rid]
                ms = (now - p.started) * 1e3
                try:
                    compiled = fut.result()
                except GrammarCompileError as exc:
                    self.failures.put(key, str(exc))
                    p.errors.append(f"{p.backend}: {exc}")
                except BaseException as exc:  # noqa: BLE001 - includes Rust panics surfacing as BaseException
                    logger.exception("grammar backend %s crashed while compiling", p.backend)
                    self.failures.put(key, f"backend error: {type(exc).__name__}: {exc}")
                    p.errors.append(f"{p.backend}: backend error: {exc}")
                else:
                    self.cache.put(key, compiled)
                    self.stats["compiled"] += 1
                    logger.info("grammar for %s compiled by %s in %.1f ms", rid, p.backend, ms)
                    out.append(self._ready(rid, p.backend, compiled, ms))
                    continue
                resp = self._try_next(p)
                if resp is not None:
                    out.append(resp)
            elif fut.running() and now - p.started > self.compile_timeout_s:
                del self.pending[rid]
                self.stats["timeouts"] += 1
                msg = f"compiling the grammar took longer than the {self.compile_timeout_s:g} s limit"
                self.failures.put(key, msg)
                logger.warning("grammar for %s: %s (%s)", rid, msg, p.backend)
                # A thread cannot be stopped: it finishes in the background and its result is dropped. New
                # compiles go to a fresh pool so they never queue behind it.
                self._abandon_pool()
                out.append(GrammarCompileResp(rid, None, f"{p.backend}: {msg}"))
        return out

    def _abandon_pool(self) -> None:
        old = self.pool
        self.pool = ThreadPoolExecutor(max_workers=self.compile_threads, thread_name_prefix="grammar-compile")
        # Compiles still queued on the old pool move over: resubmit them (the running one stays behind).
        for p in self.pending.values():
            if p.future is not None and p.future.cancel():
                p.started = time.monotonic()
                p.future = self.pool.submit(self._timed_compile, p, p.backend, p.grammar)
        old.shutdown(wait=False)

    def abort(self, rid: str) -> None:
        self.pending.pop(rid, None)
        self.matchers.pop(rid, None)

    # --- stepping -----------------------------------------------------------------------------

    def step(self, req: GrammarStepReq) -> GrammarStepResp:
        t0 = time.perf_counter()
        rejected = []
        for rid in req.free:
            self.abort(rid)
        for rid, token in req.accept:
            m = self.matchers.get(rid)
            if m is None or not m.accept_token(token):
                rejected.append(rid)
        for rid, row in req.fill:
            m = self.matchers.get(rid)
            if m is None:
                self.bitmask[row].fill_(-1)  # unknown request: leave it unconstrained rather than all-masked
                rejected.append(rid)
                continue
            m.fill_bitmask(self.bitmask, row)
        return GrammarStepResp(req.step, rejected, (time.perf_counter() - t0) * 1e3)
