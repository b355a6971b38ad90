"""Compiling in killable worker processes, for the backend whose compiles can run for many seconds (outlines-core).

A compile on a thread cannot be stopped: past its timeout it keeps a core busy until it ends. A compile in
a worker process can. ``ProcessCompiler`` runs up to ``max_workers`` worker processes (started when compiles
are waiting and no worker is free), each with its own copy of the backend, gives each one grammar at a time
and hands back a ``Future`` as an executor would; ``kill(future)`` SIGKILLs the worker running that compile
and a fresh worker takes its place. The compiled grammar comes back pickled over a socket: outlines-core's
``Index`` pickles to its binary form in 1-5 ms for a typical 0.3-2 MB index, against ~100 ms to build it.

Only ``PROCESS_BACKENDS`` compile this way. xgrammar's compiled grammar serializes (``serialize_json``)
about 3x slower than it compiles and deserializing costs about one compile; llguidance compiles in ~1 ms
and its compiled form (an ``LLMatcher``) does not cross processes. See docs/benchmarks.md.

A worker that dies on its own (a crash, the OOM killer) fails its compile with an error and is replaced,
where a crash on a compile thread would take the grammar worker down. Compile workers are plain subprocesses
(``python -m gramserve.grammar.compile_process FD``), so they can be started from a daemonic process too;
they exit when their parent goes away.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from gramserve.grammar.backends import create_backend
from gramserve.grammar.backends._structural_tag import map_json_schemas, tag_schemas
from gramserve.grammar.backends._structural_tag import normalize as normalize_tag
from gramserve.grammar.backends.base import GrammarBackend, GrammarCompileError, GrammarOptions, GrammarSpec
from gramserve.grammar.disk_cache import PERSISTED_BACKENDS, DiskCache, backend_fingerprint
from gramserve.grammar.pattern_dialect import dialect_patterns
from gramserve.grammar.schema_audit import beyond_regular, unenforced
from gramserve.grammar.schema_checks import SchemaProblem, schema_problem
from gramserve.grammar.schema_normalize import (
    aligned_multiple_bounds,
    anchor_patterns,
    bound_unbounded,
    drop_ref_annotations,
    format_patterns,
    hoist_deep_refs,
    integral_counts,
    rewrite_not,
)
from gramserve.grammar.schema_relax import relax
from gramserve.messages import GrammarRequest

logger = logging.getLogger(__name__)

PROCESS_BACKENDS = ("outlines",)
START_TIMEOUT_S = 180.0  # a loaded 2-core box needs ~10 s to import torch and build the vocabulary


NOTHING_TO_RELAX = "nothing to relax"  # a relaxed compile whose schema relaxing left as it was


class CompileWorkerDied(RuntimeError):
    """The worker process ended (killed or crashed) while compiling."""


def compile_grammar(backend: GrammarBackend, grammar: GrammarRequest, relaxed: bool = False) -> object:
    """What a compile does on a thread or in a worker: the schema audit, then the backend's compile. `relaxed`
    compiles the closest enforceable schema instead (schema_relax.py); its outputs need the server's last check.
    The JSON schemas inside a structural tag (tool-call arguments) are normalized, audited and relaxed alike."""
    text = grammar.text
    if problem := _schema_problem(grammar):
        raise SchemaProblem(problem)
    if grammar.kind == "json_schema":
        text = _normalized_schema(text, backend, relaxed)
    elif grammar.kind == "structural_tag":
        text = _normalized_tag(text, backend, relaxed)
    error = audit_error(backend.name, GrammarRequest(grammar.kind, text, grammar.backend))
    if error:
        raise GrammarCompileError(error)
    return backend.compile(GrammarSpec(grammar.kind, text))


def _schema_problem(grammar: GrammarRequest) -> str | None:
    """Why a JSON schema of the grammar (the schema itself, or one inside a structural tag) cannot be served."""
    if grammar.kind == "json_schema":
        return schema_problem(grammar.text)
    if grammar.kind == "structural_tag":
        try:
            schemas = tag_schemas(grammar.text)
        except GrammarCompileError:
            return None  # the backend reports what is wrong with the tag
        for schema in schemas:
            if problem := schema_problem(json.dumps(schema, ensure_ascii=False)):
                return f"a JSON schema of the structural tag: {problem}"
    return None


def audit_error(backend_name: str, grammar: GrammarRequest) -> str | None:
    """Why `backend_name` would not enforce the grammar (schema_audit.py), or None."""
    if grammar.kind == "json_schema":
        gaps = unenforced(backend_name, grammar.text)
        if gaps:
            return f"the schema uses {', '.join(gaps)}, which {backend_name} does not enforce"
    elif grammar.kind == "regex" and beyond_regular(grammar.text):
        return f"{backend_name} cannot enforce lookaround or backreferences in a regex"
    elif grammar.kind == "structural_tag":
        try:
            schemas = tag_schemas(grammar.text)
        except GrammarCompileError:
            return None  # the backend reports what is wrong with the tag
        gaps = sorted({gap for schema in schemas for gap in unenforced(backend_name, json.dumps(schema))})
        if gaps:
            return f"a JSON schema of the structural tag uses {', '.join(gaps)}, which {backend_name} does not enforce"
    return None


def _normalized_schema(text: str, backend: GrammarBackend, relaxed: bool) -> str:
    """The schema text as compiled, parsed once (see `_normalized`)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text  # the backend reports the syntax error
    rewritten, dropped = _normalized(schema, backend, relaxed)
    if relaxed and not dropped:
        raise GrammarCompileError(NOTHING_TO_RELAX)  # the exact compile already failed for another reason
    return text if rewritten is schema else json.dumps(rewritten)


def _normalized_tag(text: str, backend: GrammarBackend, relaxed: bool) -> str:
    """The structural tag as compiled: each of its JSON schemas as `_normalized_schema` makes it."""
    try:
        tag = normalize_tag(text)
    except GrammarCompileError:
        return text  # the backend reports what is wrong with the tag
    dropped_any: list[str] = []

    def one(schema: dict) -> dict:
        rewritten, dropped = _normalized(schema, backend, relaxed)
        dropped_any.extend(dropped)
        return rewritten

    map_json_schemas(tag["format"], one)
    if relaxed and not dropped_any:
        raise GrammarCompileError(NOTHING_TO_RELAX)
    return json.dumps(tag)


def _normalized(schema: object, backend: GrammarBackend, relaxed: bool) -> tuple[object, list[str]]:
    """Annotations beside references dropped (drop_ref_annotations), references into rewritten keywords pointed at
    copies (hoist_deep_refs), `not` stated positively where it can be (rewrite_not), counts written as floats made
    ints (integral_counts), bounds next to `multipleOf` moved onto multiples (aligned_multiple_bounds), date, time,
    IPv4 and host name formats written as patterns the last check accepts (format_patterns), unbounded
    strings and arrays bounded if the server asks (bound_unbounded), and with
    `relaxed` what no grammar enforces taken out (schema_relax.relax); then, for a backend that searches for
    patterns, unanchored patterns anchored at the start (anchor_patterns); patterns as Python's `re` reads them
    (pattern_dialect). Returns the schema (the same object if unchanged) and what was dropped."""
    options = backend.options
    rewritten = integral_counts(rewrite_not(hoist_deep_refs(drop_ref_annotations(schema))))
    rewritten = format_patterns(aligned_multiple_bounds(rewritten))
    rewritten = bound_unbounded(rewritten, options.max_string_length, options.max_array_items)
    dropped: list[str] = []
    if relaxed:
        rewritten, dropped = relax(rewritten)
    rewritten = dialect_patterns(rewritten)
    if backend.searches_patterns:
        rewritten = anchor_patterns(rewritten)
    return rewritten, dropped


@dataclass
class CompileResult:
    """What a compile job gives back, on a thread or from a worker process."""

    compiled: object
    source: str = "compiled"  # or "disk": loaded from the disk cache
    fill_us: float | None = None  # the measured fill cost (fill_probe), when it was probed


@dataclass
class BackendArgs:
    """What a worker needs to build its backend (sent pickled as its first message)."""

    name: str
    tokenizer: object
    vocab_size: int
    eos_token_ids: list[int]
    options: GrammarOptions
    cache_dir: str = ""  # the disk cache (disk_cache.py) for PERSISTED_BACKENDS; "" for none


@dataclass
class _Job:
    future: Future
    grammar: GrammarRequest
    on_start: Callable[[], None] | None = None


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready: bool = False
    job: _Job | None = None
    killed: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)


class ProcessCompiler:
    """Compiles for one backend in worker processes; a compile past its time limit is killed with its worker."""

    def __init__(self, args: BackendArgs, max_workers: int = 1):
        self.args = args
        self.max_workers = max(1, max_workers)
        self._lock = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._workers: list[_Worker] = []
        self._closed = False
        self._broken: str | None = None  # why workers cannot start; then every compile fails at once
        self._ids = itertools.count()
        # Never leave workers behind, even if close() is not called.
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    # --- the executor side --------------------------------------------------------------------

    def submit(self, grammar: GrammarRequest, on_start: Callable[[], None] | None = None) -> Future:
        """Queue a compile. ``on_start`` runs when a worker takes it (the time limit counts from then)."""
        fut: Future = Future()
        with self._lock:
            if self._closed or self._broken:
                fut.set_exception(RuntimeError(self._broken or "the compiler is closed"))
                return fut
            self._queue.append(_Job(fut, grammar, on_start))
            free = sum(1 for w in self._workers if w.job is None)
            if len(self._queue) > free and len(self._workers) < self.max_workers:
                self._start_worker()
            self._lock.notify_all()
        return fut

    def kill(self, fut: Future) -> bool:
        """SIGKILL the worker running ``fut`` (a fresh one replaces it); False if no worker runs it."""
        with self._lock:
            for w in self._workers:
                if w.job is not None and w.job.future is fut:
                    w.killed = True
                    w.proc.kill()
                    return True
        return False

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def running_pid(self, fut: Future) -> int | None:
        with self._lock:
            return next((w.proc.pid for w in self._workers if w.job is not None and w.job.future is fut), None)

    @property
    def broken(self) -> str | None:
        return self._broken

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            workers = list(self._workers)
            queued = list(self._queue)
            self._queue.clear()
        for job in queued:
            job.future.cancel()
        _kill_all(workers)

    # --- workers ------------------------------------------------------------------------------

    def _start_worker(self) -> None:
        """Called with the lock held."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so that the child imports this very package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gramserve.grammar.compile_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except OSError as exc:
            ours.close()
            theirs.close()
            self._fail_all(f"cannot start a {self.args.name} compile worker: {exc}")
            return
        theirs.close()
        w = _Worker(proc, Connection(ours.detach()))
        w.thread = threading.Thread(target=self._serve, args=(w,), name=f"{self.args.name}-compile-worker", daemon=True)
        self._workers.append(w)
        w.thread.start()

    def _serve(self, w: _Worker) -> None:
        """One thread per worker: set it up, then feed it jobs one at a time until it ends."""
        try:
            w.conn.send(self.args)
            if not w.conn.poll(START_TIMEOUT_S):
                raise CompileWorkerDied(f"the worker did not start within {START_TIMEOUT_S:g} s")
            status, detail = w.conn.recv()
            if status != "ready":
                raise CompileWorkerDied(f"the worker failed to start: {detail}")
            w.ready = True
            while True:
                job = self._next_job(w)
                if job is None:
                    return
                w.conn.send((next(self._ids), job.grammar))
                try:
                    status, detail = w.conn.recv()[1:]
                except (EOFError, OSError):
                    raise
                except Exception as exc:  # noqa: BLE001 - the reply arrived whole but does not unpickle here
                    status, detail = "error", f"cannot load the compiled grammar: {type(exc).__name__}: {exc}"
                with self._lock:
                    w.job = None
                if status == "ok":
                    job.future.set_result(CompileResult(*detail))
                elif status == "rejected":
                    job.future.set_exception(GrammarCompileError(detail))
                else:
                    job.future.set_exception(RuntimeError(detail))
        except Exception as exc:  # noqa: BLE001 - EOF/OSError when it died or was killed; anything else ends it too
            self._worker_gone(w, exc)
        finally:
            w.conn.close()

    def _next_job(self, w: _Worker) -> _Job | None:
        with self._lock:
            while True:
                if self._closed or w.killed:
                    return None
                while self._queue:
                    job = self._queue.popleft()
                    if job.on_start is not None:  # before the future says "running": the clock is set then
                        job.on_start()
                    if job.future.set_running_or_notify_cancel():
                        w.job = job
                        return job
                self._lock.wait()

    def _worker_gone(self, w: _Worker, exc: BaseException) -> None:
        w.proc.kill()
        w.proc.wait()
        with self._lock:
            self._workers.remove(w)
            job, w.job = w.job, None
            if self._closed:
                return
            if not w.ready and not w.killed:  # it never started: do not respawn in a loop
                self._fail_all(f"{self.args.name} compile worker could not start: {exc}")
            elif (w.killed or self._queue) and len(self._workers) < self.max_workers:
                self._start_worker()  # a killed worker is replaced at once: the next compile finds it warm
        if job is not None and not job.future.done():
            if w.killed:
                job.future.set_exception(CompileWorkerDied("the compile worker was killed"))
            else:
                code = w.proc.returncode
                logger.error("%s compile worker %d died (exit code %s)", self.args.name, w.proc.pid, code)
                job.future.set_exception(CompileWorkerDied(f"the compile worker died (exit code {code})"))

    def _fail_all(self, why: str) -> None:
        """Called with the lock held: no worker can start, so fail what waits and what comes."""
        logger.error("%s", why)
        self._broken = why
        while self._queue:
            job = self._queue.popleft()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError(why))


def _kill_all(workers: list[_Worker]) -> None:
    for w in list(workers):
        w.killed = True
        if w.proc.poll() is None:
            w.proc.kill()
    for w in list(workers):
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# --- the worker process ----------------------------------------------------------------------


def _worker_main(fd: int) -> None:
    from gramserve.ipc import exit_when_parent_dies

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s [grammar-compile] %(levelname)s %(message)s")
    exit_when_parent_dies()
    conn = Connection(fd)
    try:
        args: BackendArgs = conn.recv()
        backend = create_backend(args.name, args.tokenizer, args.vocab_size, list(args.eos_token_ids), args.options)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    cache = None
    if args.cache_dir and args.name in PERSISTED_BACKENDS:
        try:
            cache = DiskCache(args.cache_dir, backend_fingerprint(backend))
        except OSError as exc:
            logger.warning("no grammar disk cache (%s): %s", args.cache_dir, exc)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job_id, grammar = conn.recv()
        except EOFError:
            return
        t0 = time.monotonic()
        try:
            reply = (job_id, "ok", _compile_cached(backend, grammar, cache))
        except GrammarCompileError as exc:
            reply = (job_id, "rejected", str(exc))
        except BaseException as exc:  # noqa: BLE001 - includes Rust panics
            reply = (job_id, "error", f"backend error: {type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. the result does not pickle
            conn.send((job_id, "error", f"cannot send the compiled grammar back: {type(exc).__name__}: {exc}"))
        logger.debug("compiled %s in %.1f ms", grammar.kind, (time.monotonic() - t0) * 1e3)


def _compile_cached(backend: GrammarBackend, grammar: GrammarRequest, cache: DiskCache | None) -> tuple[object, str]:
    """(compiled, source) for a CompileResult; a plain tuple, since this module runs as __main__ here."""
    if cache is not None:
        compiled = cache.load(grammar.kind, grammar.text)
        if compiled is not None:
            return compiled, "disk"
    compiled = compile_grammar(backend, grammar)
    if cache is not None:
        cache.store(grammar.kind, grammar.text, compiled)
    return compiled, "compiled"


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
