"""Batched / multi-threaded mask filling (gramserve.grammar.fill) writes exactly what row-by-row filling writes.

Real JSONSchemaBench schemas (``../shared/corpora/jsonschemabench-dev``), 40 matchers per backend advanced
by different numbers of tokens of valid instances (some completed, some terminated by EOS), rows scattered
over a bitmask whose last word is partly padding columns. No model is needed, only the default tokenizer.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from gramserve.grammar.backends import BACKEND_NAMES, GrammarCompileError, GrammarOptions, GrammarSpec, create_backend
from gramserve.grammar.backends.base import Matcher
from gramserve.grammar.fill import FillPool, fill_rows, resolve_fill_threads
from tests.grammar_eval import corpus_files, load_case, small_cases, stratified_sample

CORPUS = Path(__file__).parents[1] / ".." / "shared" / "corpora" / "jsonschemabench-dev"
EOS = 2
EXTRA_COLUMNS = 77  # logits wider than the tokenizer, not a multiple of 32: the last word is part padding
SCHEMAS = 6
MATCHERS = 40
ROWS = 64

needs_corpus = pytest.mark.skipif(not CORPUS.is_dir(), reason=f"corpus not found at {CORPUS}")


_backends: dict = {}


def get_backend(tokenizer, name: str):
    if name not in _backends:
        backend = create_backend(name, tokenizer, len(tokenizer) + EXTRA_COLUMNS, [EOS, 0], GrammarOptions())
        backend.fill_lanes = 2  # llguidance: every grammar compiled twice, its matchers on alternate lanes
        _backends[name] = backend
    return _backends[name]


def corpus_cases(backend, tokenizer) -> list[tuple[object, list[int]]]:
    """(compiled grammar, token ids of a valid instance) for the first SCHEMAS small corpus schemas the
    backend compiles and whose instance it accepts."""
    out = []
    for _, text, valid in small_cases(CORPUS, 40, 2500):
        try:
            compiled = backend.compile(GrammarSpec("json_schema", text))
        except GrammarCompileError:
            continue
        backend.add_lanes(compiled)  # as the grammar service does after the first answer
        ids = tokenizer.encode(json.dumps(valid[0], separators=(",", ":")), add_special_tokens=False)
        probe = backend.matcher(compiled)
        if all(probe.accept_token(t) for t in ids) and probe.can_terminate():
            out.append((compiled, ids))
        if len(out) == SCHEMAS:
            return out
    pytest.fail(f"only {len(out)} usable corpus schemas for {backend.name}")


def advanced_matchers(backend, cases, n: int) -> list[tuple[Matcher, list[int]]]:
    """n matchers at different depths: (matcher, the instance tokens it has still to accept). Every 7th
    has accepted all its tokens and EOS (terminated), every 5th all its tokens (complete)."""
    out = []
    for i in range(n):
        compiled, ids = cases[i % len(cases)]
        m = backend.matcher(compiled)
        if i % 7 == 3:
            depth = len(ids) + 1
        elif i % 5 == 1:
            depth = len(ids)
        else:
            depth = (i * 11) % max(1, len(ids))
        for t in ids[:depth]:
            assert m.accept_token(t)
        if depth > len(ids):
            assert m.accept_token(EOS) and m.is_terminated()
        out.append((m, ids[depth:]))
    return out


def garbage(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)


def assert_same_fill(items: list[tuple[Matcher, int]], words: int, pool: FillPool, seed: int) -> None:
    serial, batched = garbage(ROWS, words, seed), garbage(ROWS, words, seed)
    for m, row in items:
        m.fill_bitmask(serial, row)
    fill_rows(items, batched, pool)
    for m, row in items:
        assert torch.equal(serial[row], batched[row]), f"row {row} differs ({type(m).__name__})"
    assert torch.equal(serial, batched), "rows outside the step changed"


@needs_corpus
@pytest.mark.parametrize("name", BACKEND_NAMES)
@pytest.mark.parametrize("threads,parallel_rows", [(1, 32), (4, 8), (4, 64)], ids=["1thread", "4threads", "4small"])
def test_batched_fill_equals_serial(tokenizer, name, threads, parallel_rows, caplog):
    backend = get_backend(tokenizer, name)
    matchers = advanced_matchers(backend, corpus_cases(backend, tokenizer), MATCHERS)
    assert any(m.is_terminated() for m, _ in matchers)
    assert any(m.can_terminate() and not m.is_terminated() for m, _ in matchers)
    words = (backend.vocab_size + 31) // 32
    assert words * 32 > backend.vocab_size
    pool = FillPool(threads=threads, min_batch_rows=1, parallel_rows=parallel_rows)
    rng = random.Random(threads)
    with caplog.at_level(logging.ERROR, logger="gramserve.grammar.fill"):
        for step in range(4):  # fill, then move every matcher one token on, and again
            rows = rng.sample(range(ROWS), len(matchers))
            assert_same_fill([(m, row) for (m, _), row in zip(matchers, rows)], words, pool, seed=step)
            for i, (m, rest) in enumerate(matchers):
                if rest:
                    assert m.accept_token(rest[0])
                    matchers[i] = (m, rest[1:])
                elif not m.is_terminated() and step % 2:
                    assert m.accept_token(EOS)
    assert not caplog.records, "the batch path failed and fell back to the serial one"


@needs_corpus
def test_mixed_backends_in_one_step(tokenizer):
    items = []
    rows = iter(random.Random(0).sample(range(ROWS), ROWS))
    for name in BACKEND_NAMES:
        backend = get_backend(tokenizer, name)
        for m, _ in advanced_matchers(backend, corpus_cases(backend, tokenizer), 12):
            items.append((m, next(rows)))
    random.Random(1).shuffle(items)
    words = (get_backend(tokenizer, BACKEND_NAMES[0]).vocab_size + 31) // 32
    assert_same_fill(items, words, FillPool(threads=2, min_batch_rows=4, parallel_rows=8), seed=7)


def test_small_groups_and_zero_threads_stay_serial(monkeypatch):
    calls = []

    class Fake(Matcher):
        accept_token = is_terminated = can_terminate = None

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = row

        @classmethod
        def fill_rows(cls, rows, bitmask, pool):
            calls.append(len(rows))
            super().fill_rows(rows, bitmask, pool)

    Fake.__abstractmethods__ = frozenset()
    bitmask = torch.zeros(8, 3, dtype=torch.int32)
    items = [(Fake(), r) for r in range(5)]
    fill_rows(items[:3], bitmask, FillPool(threads=2, min_batch_rows=4))
    fill_rows(items, bitmask, FillPool(threads=0, min_batch_rows=1))
    assert calls == []
    fill_rows(items, bitmask, FillPool(threads=2, min_batch_rows=4))
    assert calls == [5]
    fill_rows(items + [(Fake(), 0)], bitmask, FillPool(threads=2, min_batch_rows=1))  # a row twice: serial
    assert calls == [5]
    assert bitmask[:5, 0].tolist() == [0, 1, 2, 3, 4]


def test_failing_batch_hook_falls_back_to_serial(caplog):
    class Fake(Matcher):
        accept_token = is_terminated = can_terminate = None

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 7

        @classmethod
        def fill_rows(cls, rows, bitmask, pool):
            bitmask[rows[0][1]] = 99
            raise RuntimeError("batch API broke")

    Fake.__abstractmethods__ = frozenset()
    bitmask = torch.zeros(6, 2, dtype=torch.int32)
    fill_rows([(Fake(), r) for r in range(6)], bitmask, FillPool(threads=2, min_batch_rows=1))
    assert torch.all(bitmask == 7)
    assert "batch API broke" in caplog.text


def test_threads_for_a_batch():
    pool = FillPool(threads=6, parallel_rows=32, parallel_us=300)
    assert [pool.threads_for(n) for n in (1, 31, 32, 500)] == [1, 1, 6, 6]
    # Fewer rows go on threads once their backend's measured cost says one thread would take 300 us.
    pool.record("slow", rows=10, seconds=2e-3, threads=1)  # 200 us a row
    assert [pool.threads_for(n, "slow") for n in (1, 2, 31)] == [1, 6, 6]
    assert pool.threads_for(31, "fast") == 1 and FillPool(threads=1).threads_for(500, "slow") == 1
    pool.record("slow", rows=10, seconds=1e-5, threads=1)  # then 1 us a row: a moving mean, 160 us after one step
    assert pool.threads_for(1, "slow") == 1 and pool.threads_for(2, "slow") == 6
    made = []
    ex = pool.executor("x", 6, lambda n: made.append(n) or object())
    assert pool.executor("x", 6, lambda n: made.append(n)) is ex and made == [6]


@needs_corpus
def test_llguidance_lanes(tokenizer):
    """One compile answers a new grammar's first requests; then add_lanes compiles it again per lane (copies of one
    prototype share a lock), matchers take the lanes in turn, and a threaded fill over rows of both lanes writes
    what row by row writes."""
    backend = get_backend(tokenizer, "llguidance")
    _, ids = corpus_cases(backend, tokenizer)[0]
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}})))
    assert len(compiled.protos) == 1  # one compile answers the first requests
    first = [backend.matcher(compiled) for _ in range(2)]
    assert [m.lane for m in first] == [0, 0]
    backend.add_lanes(compiled)  # the grammar service does it in the background after that answer
    backend.add_lanes(compiled)  # and only up to fill_lanes
    assert len(compiled.protos) == 2 and compiled.protos[0] is not compiled.protos[1]
    compiled, ids = corpus_cases(backend, tokenizer)[0]
    matchers = [backend.matcher(compiled) for _ in range(6)]
    lanes = [m.lane for m in matchers]
    assert lanes in ([0, 1] * 3, [1, 0] * 3)
    for i, m in enumerate(matchers):
        for t in ids[: i + 1]:
            assert m.accept_token(t)
    words = (backend.vocab_size + 31) // 32
    pool = FillPool(threads=2, min_batch_rows=1, parallel_rows=2)
    assert_same_fill([(m, 3 * i) for i, m in enumerate(matchers)], words, pool, seed=3)
    assert pool.row_us("LLGuidanceMatcher") is not None  # the threaded path ran and measured itself


def test_resolve_fill_threads(monkeypatch):
    import gramserve.grammar.fill as fill

    monkeypatch.setattr(fill, "available_cores", lambda: 2)
    assert resolve_fill_threads("auto") == 1
    monkeypatch.setattr(fill, "available_cores", lambda: 16)
    assert resolve_fill_threads("auto") == 8
    monkeypatch.setattr(fill, "available_cores", lambda: 64)
    assert resolve_fill_threads(None) == 8
    # Grammar workers share the half of the cores: 8 on 16 cores get one thread each.
    monkeypatch.setattr(fill, "available_cores", lambda: 16)
    assert resolve_fill_threads("auto", shards=8) == 1 and resolve_fill_threads("auto", shards=2) == 4
    assert resolve_fill_threads(2, shards=8) == 2
    assert resolve_fill_threads(0) == 0 and resolve_fill_threads("3") == 3
    with pytest.raises(ValueError):
        resolve_fill_threads(-1)


@needs_corpus
def test_service_step_fills_in_batches(tokenizer):
    """GrammarService.step with fill threads writes what the row-by-row service writes."""
    import time

    from gramserve.grammar.service import GrammarService
    from gramserve.messages import GrammarCompileReq, GrammarRequest, GrammarStepReq
    from gramserve.sampling.bitmask import allocate_bitmask

    vocab = len(tokenizer) + EXTRA_COLUMNS
    schemas = []
    for path in stratified_sample(corpus_files(CORPUS), 60)[:40]:
        schema, tests = load_case(path)
        valid = [t["data"] for t in tests if t.get("valid")]
        if valid and len(json.dumps(schema)) < 1500:
            schemas.append((json.dumps(schema), json.dumps(valid[0], separators=(",", ":"))))
    schemas = schemas[:4]
    services = []
    for threads in (0, 3):
        svc = GrammarService(
            tokenizer,
            vocab,
            [EOS],
            GrammarOptions(),
            allocate_bitmask(ROWS, vocab),
            default_backend="auto",
            fill_threads=threads,
        )
        for i in range(24):
            svc.submit(
                GrammarCompileReq(
                    f"r{i}",
                    GrammarRequest(
                        "json_schema", schemas[i % len(schemas)][0], backend="xgrammar" if i % 2 else "llguidance"
                    ),
                )
            )
        deadline = time.monotonic() + 120
        while svc.pending and time.monotonic() < deadline:
            svc.poll_compiles()
            time.sleep(0.01)
        services.append(svc)
    assert services[0].matchers.keys() == services[1].matchers.keys() and len(services[0].matchers) >= 12
    assert services[1].fill_pool.threads == 3
    rids = sorted(services[0].matchers)
    texts = {f"r{i}": tokenizer.encode(schemas[i % len(schemas)][1], add_special_tokens=False) for i in range(24)}
    for step in range(6):
        accept = [(rid, texts[rid][step - 1]) for rid in rids if 0 < step <= len(texts[rid])]
        fill = [(rid, (7 * k + step) % ROWS) for k, rid in enumerate(rids)]
        for svc in services:
            assert svc.step(GrammarStepReq(step, accept, fill, [])).rejected == []
        assert torch.equal(services[0].bitmask, services[1].bitmask)
