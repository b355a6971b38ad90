"""Compiles in killable worker processes (gramserve.grammar.compile_process) and GrammarService around them.

The runaway compile is an outlines-core regex whose DFA has ~2^16 states: it runs for minutes with little
memory, so only the kill can end it within the test. No model is needed, only the default tokenizer.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from gramserve.grammar.backends import GrammarOptions
from gramserve.grammar.compile_process import BackendArgs, CompileWorkerDied, ProcessCompiler
from gramserve.grammar.service import GrammarService
from gramserve.messages import GrammarCompileReq, GrammarRequest
from gramserve.sampling.bitmask import allocate_bitmask

EOS = 2
RUNAWAY = "(a|b)*a(a|b){16}"  # outlines-core: minutes of CPU (the {12} version takes ~3 s)


@pytest.fixture
def service(tokenizer):
    svc = GrammarService(
        tokenizer,
        len(tokenizer),
        [EOS],
        GrammarOptions(),
        allocate_bitmask(4, len(tokenizer)),
        default_backend="outlines",
        compile_timeout_s=1.5,
        compile_threads=1,
        fill_threads=0,
    )
    yield svc
    svc.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_for(service: GrammarService, rid: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for resp in service.poll_compiles():
            if resp.rid == rid:
                return resp
        time.sleep(0.01)
    raise AssertionError(f"no compile response for {rid}")


def compile_req(rid: str, kind: str, text: str, backend: str = "outlines") -> GrammarCompileReq:
    return GrammarCompileReq(rid, GrammarRequest(kind, text, backend=backend))


def test_worker_compiles_and_the_matcher_works(service, tokenizer):
    assert service.submit(compile_req("a", "regex", r"[0-9]{3}-[a-z]+")) is None
    resp = wait_for(service, "a")
    assert resp.error is None and resp.backend == "outlines"
    assert service._compilers["outlines"].worker_pids(), "compiled in a worker process"
    m = service.matchers["a"]
    assert all(m.accept_token(t) for t in tokenizer.encode("123-abc", add_special_tokens=False))
    assert m.can_terminate() and m.accept_token(EOS)
    # Cached: the second request needs no worker.
    assert service.submit(compile_req("b", "regex", r"[0-9]{3}-[a-z]+")).error is None
    # Rejections come back as rejections (and go to the negative cache).
    assert service.submit(compile_req("c", "ebnf", 'root ::= "x"')) is None
    assert "not supported by outlines-core" in wait_for(service, "c").error
    assert "not supported" in service.submit(compile_req("d", "ebnf", 'root ::= "x"')).error


def test_runaway_compile_worker_is_killed(service):
    compiler = service._compiler("outlines")
    assert service.submit(compile_req("slow", "regex", RUNAWAY)) is None
    pending = service.flight_of("slow")
    deadline = time.monotonic() + 120
    pid = None
    while pid is None and time.monotonic() < deadline:  # the worker may still be starting
        pid = compiler.running_pid(pending.future)
        time.sleep(0.05)
    assert pid is not None and pid != os.getpid()
    ticks = cpu_ticks(pid)
    resp = wait_for(service, "slow")
    assert "longer than the 1.5 s limit" in resp.error
    assert cpu_ticks(pid) > ticks if alive(pid) else True  # it was busy compiling
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the runaway compile's worker still runs"
    assert service.stats["timeouts"] == 1
    # Negative-cached; a fresh worker serves the next compile.
    assert "limit" in service.submit(compile_req("again", "regex", RUNAWAY)).error
    assert service.submit(compile_req("next", "regex", "x+")) is None
    assert wait_for(service, "next").error is None
    assert pid not in compiler.worker_pids() and compiler.worker_pids()


def test_auto_reports_a_timed_out_process_compile(tokenizer):
    # outlines is last in the auto order: with the other two ruled out, its timeout is the answer.
    svc = GrammarService(
        tokenizer,
        len(tokenizer),
        [EOS],
        GrammarOptions(),
        allocate_bitmask(2, len(tokenizer)),
        default_backend="auto",
        compile_timeout_s=1.0,
        compile_threads=1,
        fill_threads=0,
    )
    try:
        svc.failures.put(("xgrammar", "regex", RUNAWAY), "pretend xgrammar rejected it")
        svc.failures.put(("llguidance", "regex", RUNAWAY), "pretend llguidance rejected it")
        assert svc.submit(compile_req("r", "regex", RUNAWAY, backend="auto")) is None
        resp = wait_for(svc, "r")
        assert resp.backend is None and "outlines" in resp.error and "limit" in resp.error
    finally:
        svc.close()


def test_crashed_worker_fails_its_compile_only(service):
    compiler = service._compiler("outlines")
    assert service.submit(compile_req("boom", "regex", RUNAWAY)) is None
    deadline = time.monotonic() + 120
    pid = None
    while pid is None and time.monotonic() < deadline:
        pid = compiler.running_pid(service.flight_of("boom").future)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    resp = wait_for(service, "boom")
    assert "compile worker died" in resp.error
    assert service.submit(compile_req("fine", "regex", "[0-9]+")) is None
    assert wait_for(service, "fine").error is None


def test_workers_that_cannot_start_fall_back_to_threads(service, monkeypatch):
    import gramserve.grammar.compile_process as cp

    service._compilers.pop("outlines").close()  # the service started one at once (default backend)
    monkeypatch.setattr(cp.sys, "executable", "/nonexistent/python")
    assert service.submit(compile_req("t", "regex", "[a-c]+")) is None
    resp = wait_for(service, "t")
    assert resp.error is None, resp.error
    assert service._compilers["outlines"].broken
    assert not service.pending and "t" in service.matchers


def test_process_compiler_on_its_own(tokenizer):
    pc = ProcessCompiler(BackendArgs("outlines", tokenizer, len(tokenizer), [EOS], GrammarOptions()), max_workers=2)
    try:
        futs = [pc.submit(GrammarRequest("regex", f"[0-9]{{{n}}}")) for n in (1, 2, 3)]
        assert [type(f.result(timeout=120).compiled).__name__ for f in futs] == ["_OutlinesCompiled"] * 3
        assert 1 <= len(pc.worker_pids()) <= 2
        slow = pc.submit(GrammarRequest("regex", RUNAWAY))
        while not slow.running():
            time.sleep(0.01)
        time.sleep(0.2)
        assert pc.kill(slow)
        with pytest.raises(CompileWorkerDied):
            slow.result(timeout=30)
        assert not pc.kill(slow)
    finally:
        pids = pc.worker_pids()
        pc.close()
    assert not any(alive(pid) for pid in pids)
