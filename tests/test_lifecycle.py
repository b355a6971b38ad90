"""Process lifecycle with real servers: bad model path, a dying scheduler, Ctrl-C and SIGTERM.

Each server start costs 10-20 s on a small CPU box, so this file starts three.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

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


def _start(servers, tmp_path) -> tuple[ServerProcess, list[int]]:
    srv = start_server(str(tmp_path))
    servers.append(srv)
    children = srv.child_pids()
    spawned = [p for p in children if "spawn_main" in _cmdline(p)]
    assert len(spawned) == 3, f"expected scheduler, detokenizer and grammar children, got {_describe(children)}"
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


def test_scheduler_death_stops_the_server(servers, tmp_path, ipc_tmp):
    srv, children = _start(servers, tmp_path)
    spawned = [p for p in children if "spawn_main" in _cmdline(p)]
    # The scheduler holds the model weights: by far the largest of the spawned children.
    scheduler = max(spawned, key=_rss_kb)
    os.kill(scheduler, signal.SIGKILL)

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


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_graceful_shutdown(servers, tmp_path, ipc_tmp, how):
    srv, children = _start(servers, tmp_path)
    if how == "ctrl-c":
        # A terminal's Ctrl-C signals the whole foreground process group (the server runs in its own session).
        os.killpg(srv.proc.pid, signal.SIGINT)
    else:
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
