"""Check and time grammar backends on a JSON-Schema corpus (JSONSchemaBench layout).

Each corpus file is ``{"schema": ..., "tests": [{"valid": bool, "data": ...}]}``. For a schema we
compile it (in a worker thread with a time limit, so a pathological schema cannot stall the
caller), then feed every test instance, serialized with ``json.dumps`` (compact separators, plus the
default ``", "``/``": "`` ones when the backend allows whitespace), token by token through a matcher
and finish with EOS. A valid instance counts as accepted when every serialization is accepted; an
invalid one as rejected when every serialization is rejected.

:func:`run_corpus` runs one backend over many files in a worker process (forkserver, so no
threads or thread pools are inherited): a compile that exceeds the time limit gets the worker
killed (a compile cannot be interrupted otherwise, and an abandoned compile thread would keep a core
busy) and a fresh worker continues with the next file.

Used by tests (``test_grammar_corpus.py``, ``test_grammar_parallel_fill.py``, ``test_xgrammar_whitespace.py``) and
benchmarks (``bench_grammar.py``, ``bench_mask_fill.py``), as ``tests.grammar_eval`` with the repository root on
``sys.path``; no model needed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema

from gramserve.grammar.backends import GrammarBackend, GrammarCompileError, GrammarSpec, create_backend
from gramserve.sampling.bitmask import allocate_bitmask
from gramserve.server.output_check import CHECK_KEYWORDS, PatternTimeout, output_number


def category(path: Path) -> str:
    """Corpus file category: the part before ``---`` (Github_easy---x.json) or before _N.json."""
    name = path.name
    if "---" in name:
        return name.split("---", 1)[0]
    return re.sub(r"_\d+\.json$", "", name)


def corpus_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.json"))


def stratified_sample(files: list[Path], every: int) -> list[Path]:
    """Every ``every``-th file of each category (sorted by name): deterministic, keeps proportions."""
    groups: dict[str, list[Path]] = defaultdict(list)
    for f in sorted(files):
        groups[category(f)].append(f)
    out: list[Path] = []
    for cat in sorted(groups):
        out.extend(groups[cat][::every])
    return out


def load_case(path: Path) -> tuple[object, list[dict]]:
    with open(path) as f:
        doc = json.load(f)
    return doc.get("schema"), list(doc.get("tests") or [])


def small_cases(root: Path, every: int, max_bytes: int) -> Iterator[tuple[Path, str, list]]:
    """(file, schema text, valid instances) for the schemas of ``stratified_sample(corpus_files(root), every)``
    that are at most ``max_bytes`` long and have a valid instance: the sample that mask tests and benchmarks walk."""
    for path in stratified_sample(corpus_files(root), every):
        schema, tests = load_case(path)
        valid = [t["data"] for t in tests if t.get("valid")]
        text = json.dumps(schema)
        if valid and len(text) <= max_bytes:
            yield path, text, valid


def serializations(data, whitespace_allowed: bool) -> list[str]:
    texts = [json.dumps(data, separators=(",", ":"))]
    if whitespace_allowed:
        spaced = json.dumps(data)
        if spaced != texts[0]:
            texts.append(spaced)
    return texts


@dataclass
class SchemaResult:
    path: str
    status: str  # "ok" | "error" | "timeout" | "skipped"
    compile_s: float = 0.0
    error: str = ""
    valid_total: int = 0
    valid_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    first_mask_s: float | None = None  # matcher creation + first fill_bitmask
    mask_s: list[float] = field(default_factory=list)  # per-token fill_bitmask times (when timed)
    mismatches: int = 0  # mask/accept_token disagreements (when masks are checked)


def compile_with_timeout(
    backend: GrammarBackend, spec: GrammarSpec, timeout_s: float
) -> tuple[str, object, float, str]:
    """(status, compiled, seconds, error). A compile still running after timeout_s is abandoned
    (its daemon thread finishes in the background; all three libraries release the GIL)."""
    box: dict = {}

    def work():
        t0 = time.perf_counter()
        try:
            box["compiled"] = backend.compile(spec)
        except GrammarCompileError as e:
            box["error"] = str(e)
        except BaseException as e:  # noqa: BLE001 - must never happen, but never crash the caller
            box["error"] = f"unexpected {type(e).__name__}: {e}"
        box["s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    th = threading.Thread(target=work, name=f"compile-{backend.name}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return "timeout", None, time.perf_counter() - t0, f"compile took longer than {timeout_s:g} s"
    if "error" in box:
        return "error", None, box["s"], box["error"]
    return "ok", box["compiled"], box["s"], ""


def _allowed(bitmask, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def walk(
    backend: GrammarBackend,
    compiled,
    token_ids: list[int],
    *,
    bitmask=None,
    check_mask=False,
    mask_times=None,
    result=None,
) -> bool:
    """Feed tokens then EOS; True when all are accepted and the matcher ends terminated.
    With a bitmask: fill it before every token (timing it into mask_times when given) and, with
    check_mask, count disagreements between the mask and accept_token in result.mismatches."""
    eos = backend.eos_token_ids[0]
    try:
        m = backend.matcher(compiled)
        for tok in [*token_ids, eos]:
            if bitmask is not None:
                t0 = time.perf_counter()
                m.fill_bitmask(bitmask, 0)
                if mask_times is not None:
                    mask_times.append(time.perf_counter() - t0)
            ok = m.accept_token(tok)
            if check_mask and bitmask is not None and result is not None and _allowed(bitmask, tok) != ok:
                result.mismatches += 1
            if not ok:
                return False
        return m.is_terminated()
    except BaseException as e:  # noqa: BLE001 - a matcher failure counts as a rejection
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return False


def run_schema(
    backend: GrammarBackend,
    tokenizer,
    path: Path,
    *,
    timeout_s: float | None = 10.0,
    whitespace_allowed: bool = True,
    check_mask: bool = False,
    time_masks: bool = False,
    max_instances: int | None = None,
    on_compiled=None,
) -> SchemaResult:
    """Compile one corpus schema and walk its instances. timeout_s None: compile in this thread."""
    schema, tests = load_case(path)
    res = SchemaResult(str(path.name), "skipped")
    if schema is None:
        res.error = "no schema"
        return res
    spec = GrammarSpec("json_schema", json.dumps(schema))
    if timeout_s is None:
        t0 = time.perf_counter()
        try:
            compiled, status, err = backend.compile(spec), "ok", ""
        except GrammarCompileError as e:
            compiled, status, err = None, "error", str(e)
        secs = time.perf_counter() - t0
    else:
        status, compiled, secs, err = compile_with_timeout(backend, spec, timeout_s)
    res.status, res.compile_s, res.error = status, secs, err
    if on_compiled is not None:
        on_compiled()
    if status != "ok":
        return res
    bitmask = allocate_bitmask(1, backend.vocab_size) if (check_mask or time_masks) else None
    if time_masks:
        t0 = time.perf_counter()
        m = backend.matcher(compiled)
        m.fill_bitmask(bitmask, 0)
        res.first_mask_s = time.perf_counter() - t0
    for test in tests[:max_instances] if max_instances else tests:
        valid = bool(test.get("valid"))
        texts = serializations(test.get("data"), whitespace_allowed)
        outcomes = []
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            times = res.mask_s if (time_masks and valid) else None
            outcomes.append(
                walk(backend, compiled, ids, bitmask=bitmask, check_mask=check_mask, mask_times=times, result=res)
            )
        if valid:
            res.valid_total += 1
            res.valid_accepted += all(outcomes)
        else:
            res.invalid_total += 1
            res.invalid_rejected += not any(outcomes)
    return res


@dataclass
class Summary:
    backend: str
    schemas: int = 0
    compiled: int = 0
    errors: int = 0
    timeouts: int = 0
    valid_total: int = 0
    valid_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    mismatches: int = 0
    seconds: float = 0.0

    def add(self, r: SchemaResult) -> None:
        self.schemas += 1
        self.compiled += r.status == "ok"
        self.errors += r.status == "error"
        self.timeouts += r.status == "timeout"
        self.valid_total += r.valid_total
        self.valid_accepted += r.valid_accepted
        self.invalid_total += r.invalid_total
        self.invalid_rejected += r.invalid_rejected
        self.mismatches += r.mismatches


# ---------------------------------------------------------------------------------------------
# Isolated corpus runs


def _worker(conn, backend_name, tokenizer, vocab_size, eos, options, paths, kwargs) -> None:
    try:
        backend = create_backend(backend_name, tokenizer, vocab_size, eos, options)
    except BaseException as e:  # noqa: BLE001
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    whitespace_allowed = options.max_whitespace is None or options.max_whitespace > 0
    for i, path in enumerate(paths):
        conn.send(("compile", i))
        res = run_schema(
            backend,
            tokenizer,
            Path(path),
            timeout_s=None,
            whitespace_allowed=whitespace_allowed,
            on_compiled=lambda i=i: conn.send(("compiled", i)),
            **kwargs,
        )
        conn.send(("result", (i, res)))
    conn.send(("done", None))


_PRELOAD = [
    "torch",
    "transformers",
    "xgrammar",
    "llguidance",
    "llguidance.hf",
    "outlines_core",
    __name__,  # this module, as the caller imported it (the worker function is pickled by that name)
]


def run_corpus(
    backend_name: str,
    tokenizer,
    vocab_size: int,
    eos_token_ids: list[int],
    options,
    files: list[Path],
    *,
    timeout_s: float = 10.0,
    walk_timeout_s: float = 300.0,
    start_timeout_s: float = 300.0,
    check_mask: bool = False,
    time_masks: bool = False,
    max_instances: int | None = None,
    progress=None,
) -> list[SchemaResult]:
    """Run ``run_schema`` for every file in a killable worker process; see the module docstring.
    ``progress(result)`` is called after each file."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    kwargs = {"check_mask": check_mask, "time_masks": time_masks, "max_instances": max_instances}
    results: list[SchemaResult | None] = [None] * len(files)

    def record(r: SchemaResult, index: int) -> None:
        results[index] = r
        if progress:
            progress(r)

    start = 0
    while start < len(files):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker,
            args=(
                child,
                backend_name,
                tokenizer,
                vocab_size,
                eos_token_ids,
                options,
                [str(f) for f in files[start:]],
                kwargs,
            ),
            daemon=True,
        )
        proc.start()
        child.close()
        current: int | None = None  # file index being compiled or walked
        phase = "start"
        since = time.monotonic()
        next_start = len(files)
        while True:
            limit = {"start": start_timeout_s, "compile": timeout_s + _COMPILE_SLACK_S, "walk": walk_timeout_s}[phase]
            if not parent.poll(max(0.0, since + limit - time.monotonic())):
                proc.kill()
                proc.join()
                if current is None:
                    raise RuntimeError(f"{backend_name} worker did not start within {start_timeout_s:g} s")
                if phase == "compile":
                    r = SchemaResult(
                        files[current].name,
                        "timeout",
                        compile_s=time.monotonic() - since,
                        error=f"compile took longer than {timeout_s:g} s",
                    )
                else:
                    r = SchemaResult(
                        files[current].name,
                        "error",
                        error=f"walking the instances took longer than {walk_timeout_s:g} s",
                    )
                record(r, current)
                next_start = current + 1
                break
            try:
                kind, payload = parent.recv()
            except EOFError:  # the worker died (e.g. a Rust abort): count the file as an error
                proc.join()
                if current is None:
                    raise RuntimeError(f"{backend_name} worker died at startup (exit code {proc.exitcode})") from None
                record(
                    SchemaResult(files[current].name, "error", error=f"worker died (exit code {proc.exitcode})"),
                    current,
                )
                next_start = current + 1
                break
            now = time.monotonic()
            if kind == "fatal":
                proc.join()
                raise RuntimeError(f"{backend_name} worker failed to start: {payload}")
            if kind == "compile":
                current, phase, since = start + payload, "compile", now
            elif kind == "compiled":
                phase, since = "walk", now
            elif kind == "result":
                i, r = payload
                if r.status == "ok" and r.compile_s > timeout_s:  # finished, but over the limit
                    r.status, r.error = "timeout", f"compile took {r.compile_s:.1f} s (limit {timeout_s:g} s)"
                    r.valid_accepted = r.invalid_rejected = 0
                record(r, start + i)
                current, phase, since = None, "start", now
            elif kind == "done":
                proc.join()
                break
            else:  # "ready"
                phase, since = "start", now
        parent.close()
        if next_start >= len(files):
            break
        start = next_start
    return [r for r in results if r is not None]


_COMPILE_SLACK_S = 0.5


def _integral(checker, value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, Decimal):
        return value.is_finite() and value == value.to_integral_value()
    return isinstance(value, int)


def instance_error(schema: Any, text: str) -> str | None:
    """Why the output `text` breaks `schema` (the draft its `$schema` names, formats checked, numbers as Decimals),
    or None when it validates or cannot be checked here (a number Python will not read, a schema the validator
    cannot read, an unresolvable $ref). The client-side check of the fuzz test and bench_corpus_validity.py."""
    try:
        instance = json.loads(text, parse_float=output_number)
        schema = json.loads(json.dumps(schema), parse_float=Decimal)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        # ECMA-262 patterns (\p{L}) through the `regex` module, as the server's check does: `re` cannot read them.
        # JSON Schema calls 5.0 an integer; numbers read as Decimals are only "number" to the default type checker.
        types = cls.TYPE_CHECKER.redefine("integer", _integral)
        cls = jsonschema.validators.extend(cls, CHECK_KEYWORDS, type_checker=types)
        error = next(iter(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance)), None)
    except PatternTimeout:
        return None  # a pattern that backtracks past its time limit: not checkable here
    except ArithmeticError:
        return None  # a number past Decimal's exponent range: valid JSON, not checkable here
    except (ValueError, RecursionError) as exc:
        if "integer string conversion" in str(exc):
            return None  # an integer of more than 4300 digits: valid JSON, not checkable here
        return f"{type(exc).__name__}: {exc}"
    except jsonschema.exceptions.SchemaError:
        return None
    except Exception as exc:  # noqa: BLE001 - an unresolvable $ref: not checkable here either
        if "Unresolvable" in type(exc).__name__:
            return None
        raise
    return None if error is None else f"{error.message[:200]} at /{'/'.join(map(str, error.absolute_path))}"
