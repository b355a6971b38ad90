"""GrammarService: compiles constraints off the hot path and keeps one matcher per constrained request.

Compiles run on worker threads (the backends release the GIL), so mask filling for running requests
never waits behind a compile; outlines-core compiles (the slow ones) run in worker processes instead
(``compile_process``). A compile that outlives its timeout (counted from when it starts running) is
answered with an error at once. A worker process running it is killed (and replaced); a thread cannot be,
so its late result is discarded and the thread pool is replaced, so later compiles never queue behind a
runaway one. Results are cached by (backend, kind, text), failures in a negative cache.
`auto` tries the backends in order and falls back to the next one when a backend rejects the grammar.
A step's mask rows are filled in batches per backend on ``fill_threads`` threads (see ``fill``).
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
from gramserve.grammar.backends.base import GrammarBackend, GrammarCompileError, GrammarOptions, Matcher
from gramserve.grammar.compile_process import PROCESS_BACKENDS, BackendArgs, ProcessCompiler, compile_grammar
from gramserve.grammar.fill import FillPool, fill_rows
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
    in_process: bool = False  # compiling in a worker process (killable) rather than on a thread


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
        default_backend: str = "xgrammar",
        compile_timeout_s: float = 5.0,
        cache_size: int = 512,
        compile_threads: int = 2,
        fill_threads: int = 1,
        compile_processes: bool = True,
    ):
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
        self.fill_pool = FillPool(fill_threads)  # resolved by server/settings.py (0: row by row)
        # Backends in PROCESS_BACKENDS compile in worker processes (made on first use) unless this is False.
        self.compile_processes = compile_processes
        self._compilers: dict[str, ProcessCompiler] = {}
        self.stats = {"compiled": 0, "cache_hits": 0, "failed": 0, "timeouts": 0}
        if default_backend != "auto":
            self.backend(default_backend)
            if self._in_process(default_backend):
                self._compiler(default_backend)  # start a worker now rather than on the first request
        else:
            self.backend(AUTO_ORDER[0])

    def backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                self._backends[name] = create_backend(
                    name, self.tokenizer, self.vocab_size, self.eos_token_ids, self.options
                )
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
            return GrammarCompileResp(
                req.rid, None, f"unknown grammar backend {name!r}; use one of {list(BACKEND_NAMES) + ['auto']}"
            )
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
            p.in_process = self._in_process(backend)
            if p.in_process:

                def started(p=p) -> None:  # the timeout counts from when a worker takes it
                    p.started = time.monotonic()

                p.future = self._compiler(backend).submit(p.grammar, on_start=started)
            else:
                p.future = self.pool.submit(self._timed_compile, p, backend, p.grammar)
            self.pending[p.rid] = p
            return None
        self.stats["failed"] += 1
        return GrammarCompileResp(p.rid, None, "; ".join(p.errors) or "grammar rejected")

    def _timed_compile(self, p: _PendingCompile, backend: str, grammar: GrammarRequest):
        p.started = time.monotonic()  # the timeout counts from the start of the work, not from the queue
        return compile_grammar(self.backend(backend), grammar)

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
            args = BackendArgs(backend, self.tokenizer, self.vocab_size, list(self.eos_token_ids), self.options)
            compiler = self._compilers[backend] = ProcessCompiler(args, max_workers=self.compile_threads)
            # This process still makes the matchers: build its copy of the backend off the hot path.
            self.pool.submit(self.backend, backend)
        return compiler

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
                    if p.in_process and self._compilers[p.backend].broken:  # no worker: compile on a thread
                        p.candidates.insert(0, p.backend)
                        resp = self._try_next(p)
                        if resp is not None:
                            out.append(resp)
                        continue
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
                if p.in_process:
                    self._compilers[p.backend].kill(fut)  # a fresh worker takes its place
                else:
                    # A thread cannot be stopped: it finishes in the background and its result is dropped.
                    # New compiles go to a fresh pool so they never queue behind it.
                    self._abandon_pool()
                out.append(GrammarCompileResp(rid, None, f"{p.backend}: {msg}"))
        return out

    def _abandon_pool(self) -> None:
        old = self.pool
        self.pool = ThreadPoolExecutor(max_workers=self.compile_threads, thread_name_prefix="grammar-compile")
        # Compiles still queued on the old pool move over: resubmit them (the running one stays behind).
        for p in self.pending.values():
            if not p.in_process and p.future is not None and p.future.cancel():
                p.started = time.monotonic()
                p.future = self.pool.submit(self._timed_compile, p, p.backend, p.grammar)
        old.shutdown(wait=False)

    def abort(self, rid: str) -> None:
        self.pending.pop(rid, None)
        self.matchers.pop(rid, None)

    def close(self) -> None:
        """Stop the compile workers and threads (running compile threads finish in the background)."""
        for compiler in self._compilers.values():
            compiler.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

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
        rows = []
        for rid, row in req.fill:
            m = self.matchers.get(rid)
            if m is None:
                self.bitmask[row].fill_(-1)  # unknown request: leave it unconstrained rather than all-masked
                rejected.append(rid)
                continue
            rows.append((m, row))
        fill_rows(rows, self.bitmask, self.fill_pool)
        return GrammarStepResp(req.step, rejected, (time.perf_counter() - t0) * 1e3)
