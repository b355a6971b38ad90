"""Process lifecycle with real servers: bad model path, a dying scheduler, Ctrl-C and SIGTERM.

Each server start costs 10-20 s on a small CPU box, so this file starts three.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from conftest import ServerProcess, _not_zombie, free_port, start_server


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and _not_zombie(pid)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` is a live process; return those still alive at the deadline."""
    deadline = time.time() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def _describe(pids: list[int]) -> str:
    return "; ".join(f"{p}: {_cmdline(p)[:120]}" for p in pids)


@pytest.fixture
def ipc_tmp(monkeypatch):
    """A private, short TMPDIR for the server (IPC socket paths must stay under ~100 characters),
    so we can check that the launcher removes its IPC folder whatever other servers run meanwhile."""
    d = tempfile.mkdtemp(prefix="gs-lc-")
    monkeypatch.setenv("TMPDIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers():
    started: list[ServerProcess] = []
    yield started
    for srv in started:  # never leave a server behind, whatever the test did
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()


def _start(servers, tmp_path, *extra: str) -> tuple[ServerProcess, list[int]]:
    srv = start_server(str(tmp_path), *extra)
    servers.append(srv)
    children = srv.child_pids()
    spawned = [p for p in children if "spawn_main" in _cmdline(p)]
    assert len(spawned) == 3, f"expected scheduler, detokenizer and grammar children, got {_describe(children)}"
    names = set()
    for p in spawned:
        with open(f"/proc/{p}/comm") as f:
            names.add(f.read().strip())
    assert names == {"gs-scheduler", "gs-detokenizer", "gs-grammar"}, names  # what ps -o comm and top show
    return srv, children


def test_nonexistent_model_exits_quickly_with_a_clear_message(ipc_tmp):
    path = "/nonexistent/x.gguf"
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "gramserve", "serve", "--model", path, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.time() - t0
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert path in out, out
    assert "does not exist" in out, out
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    assert not glob.glob(os.path.join(ipc_tmp, "gramserve-ipc-*")), "IPC folder left behind"


def test_process_names_stay_apart_in_15_bytes():
    from gramserve.server.processes import process_name

    children = ["detokenizer", "dp-controller", "scheduler", "grammar-worker", "tp-worker-1"]
    for replica in (0, 1):
        children += [f"scheduler-dp{replica}", f"tp-worker-dp{replica}-1", f"tp-worker-dp{replica}-3"]
        children += [f"grammar-worker{k}-dp{replica}" for k in range(12)]
    names = [process_name(c) for c in children]
    assert all(len(n.encode()) <= 15 for n in names) and len(set(names)) == len(names), names
    assert process_name("scheduler") == "gs-scheduler" and process_name("scheduler-dp1") == "gs-sched-dp1"


def test_a_busy_port_and_bad_limits_are_refused_before_the_model_loads():
    """A port in use or a host that does not resolve fails before the model loads (it failed after the load and
    the warm-up, blaming the detokenizer); a negative timeout was accepted and served every request a 503."""
    serve = [sys.executable, "-m", "gramserve", "serve"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [
            (["--port", port], "Address already in use"),
            (["--host", "no-such-host.invalid", "--port", str(free_port())], "cannot listen on no-such-host.invalid"),
            (["--watchdog-timeout", "-1"], "--watchdog-timeout must be more than 0"),
            (["--request-timeout", "-1"], "--request-timeout must be 0 (no limit) or more"),
            (["--shutdown-timeout", "-3"], "--shutdown-timeout must be 0 or more"),
            (["--max-running-requests", "100000000"], "--max-running-requests must be at most"),
            (["--log-level", "bogus"], "--log-level must be one of"),
        ]
        for flags, message in cases:
            t0 = time.time()
            res = subprocess.run(serve + flags, capture_output=True, text=True, timeout=120)
            assert res.returncode == 2 and message in res.stderr, (flags, res.stderr[-2000:])
            assert "Traceback" not in res.stderr and time.time() - t0 < 30, flags
    # A KV pool larger than the host's memory: refused once the model is loaded (it was killed by the OOM killer).
    res = subprocess.run(serve + ["--kv-cache-memory-gb", "100000"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "does not fit in the" in res.stderr.splitlines()[-1], res.stderr[-2000:]


class _Stream:
    """A long /generate stream read in a thread: its events, and when it ended."""

    def __init__(self, base_url: str, max_new_tokens: int = 3000):
        self.events: list[dict] = []
        self.ended_at: float | None = None
        body = {
            "text": "Count:",
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self._thread.start()
        assert self.started.wait(60), "the stream did not start"

    def _read(self, base_url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line[6:]))
                        self.started.set()
        except httpx.HTTPError:
            pass
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream is still open"

    @property
    def error(self) -> dict | None:
        return self.events[-1].get("error") if self.events else None


def _scheduler_pid(children: list[int]) -> int:
    spawned = [p for p in children if "spawn_main" in _cmdline(p)]
    return max(spawned, key=_rss_kb)  # the scheduler holds the model weights: by far the largest child


def test_frozen_scheduler_turns_health_503_and_fails_requests(servers, tmp_path):
    srv, children = _start(servers, tmp_path, "--watchdog-timeout", "3")
    scheduler = _scheduler_pid(children)
    stream = _Stream(srv.base_url)
    os.kill(scheduler, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        stream.join(timeout=30)
        assert stream.error is not None and "not responded" in stream.error["message"], stream.events[-1:]
        assert stream.ended_at - stopped_at < 10
        r = httpx.get(srv.base_url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        r = httpx.post(srv.base_url + "/generate", json={"text": "hi"}, timeout=10)
        assert r.status_code == 503 and "not responded" in r.json()["error"]["message"], r.text
    finally:
        os.kill(scheduler, signal.SIGCONT)
    deadline = time.time() + 20
    while httpx.get(srv.base_url + "/health", timeout=10).status_code != 200:
        assert time.time() < deadline, "/health did not recover after SIGCONT"
        time.sleep(0.2)
    r = httpx.post(srv.base_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    assert srv.stop() == 0


def test_scheduler_death_stops_the_server(servers, tmp_path, ipc_tmp):
    srv, children = _start(servers, tmp_path)
    stream = _Stream(srv.base_url)
    os.kill(_scheduler_pid(children), signal.SIGKILL)
    stream.join(timeout=15)  # an error event, not a cut connection
    assert stream.error is not None and "scheduler process died" in stream.error["message"], stream.events[-1:]

    try:
        code = srv.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"main process still running 15 s after the scheduler died:\n{srv.log()[-3000:]}")
    log = srv.log()
    assert code != 0, log[-3000:]
    assert "scheduler process died" in log, log[-3000:]
    assert "detokenizer process died" not in log, log[-3000:]
    assert "grammar-worker process died" not in log, log[-3000:]
    left = _wait_gone(children, timeout=10)
    assert not left, f"child processes left behind: {_describe(left)}"
    assert not glob.glob(os.path.join(ipc_tmp, "gramserve-ipc-*")), "IPC folder left behind"


@pytest.mark.parametrize("which", [0, 1])
def test_any_child_death_fails_requests_and_stops_the_server(servers, tmp_path, ipc_tmp, which):
    """The detokenizer and the grammar worker (the two children besides the scheduler, taken in pid order): killing
    either ends a running stream with an error event, and the server exits non-zero."""
    srv, children = _start(servers, tmp_path)
    scheduler = _scheduler_pid(children)
    others = sorted(p for p in children if "spawn_main" in _cmdline(p) and p != scheduler)
    assert len(others) == 2, _describe(children)
    stream = _Stream(srv.base_url)
    os.kill(others[which], signal.SIGKILL)
    stream.join(timeout=15)
    assert stream.error is not None and "process died" in stream.error["message"], stream.events[-1:]
    assert srv.proc.wait(timeout=15) != 0
    assert not _wait_gone(children, timeout=10)


def test_sigterm_lets_running_requests_finish(servers, tmp_path, ipc_tmp):
    """Draining: a short request finishes, a new one gets a 503, a long one fails with an error event at the
    --shutdown-timeout, and the server exits 0."""
    srv, children = _start(servers, tmp_path, "--shutdown-timeout", "4")
    short, long = _Stream(srv.base_url, max_new_tokens=8), _Stream(srv.base_url, max_new_tokens=3000)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r = httpx.post(srv.base_url + "/generate", json={"text": "hi"}, timeout=10)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    short.join(timeout=30)
    assert short.events[-1]["meta_info"]["finish_reason"]["type"] == "length", short.events[-1:]
    long.join(timeout=30)
    assert long.error is not None and "shutting down" in long.error["message"], long.events[-1:]
    assert srv.proc.wait(timeout=30) == 0, srv.log()[-3000:]
    assert not _wait_gone(children, timeout=10)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigterm twice"])
def test_graceful_shutdown(servers, tmp_path, ipc_tmp, how):
    """ "sigterm twice": the second signal, while a stream runs, stops the server at once (it logged a traceback)."""
    srv, children = _start(servers, tmp_path)
    stream = None
    if how == "ctrl-c":
        # A terminal's Ctrl-C signals the whole foreground process group (the server runs in its own session).
        os.killpg(srv.proc.pid, signal.SIGINT)
    elif how == "sigterm":
        srv.proc.send_signal(signal.SIGTERM)
    else:
        stream = _Stream(srv.base_url, max_new_tokens=3000)
        time.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)

    try:
        code = srv.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"main process still running 20 s after {how}:\n{srv.log()[-3000:]}")
    log = srv.log()
    assert code == 0, f"exit code {code}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    assert "process died" not in log, log[-3000:]
    left = _wait_gone(children, timeout=10)
    assert not left, f"child processes left behind: {_describe(left)}"
    assert not glob.glob(os.path.join(ipc_tmp, "gramserve-ipc-*")), "IPC folder left behind"
    if stream is not None:
        stream.join(timeout=10)
        assert stream.error is not None and "shutting down" in stream.error["message"], stream.events[-1:]
