"""Shared fixtures: a real gramserve server started as a subprocess, and clients for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

STARTUP_TIMEOUT_S = 300  # the first start converts the GGUF (~25 s); a loaded 2-core CI box is slower


def run_in_triton_interpreter(code: str) -> None:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1, so Triton kernels execute on CPU tensors; the code
    prints "ok" when its checks pass."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # tests/ too: the code may import test modules, which import this one as `conftest`
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(tmp_dir: str, *extra: str, wait: bool = True) -> ServerProcess:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "gramserve", "serve", "--port", str(port), *extra]
    log = open(log_path, "w")
    # The Batch API's data folder: the test's own, never the user's (a test may pass --data-dir).
    env = {**os.environ, "GRAMSERVE_DATA_DIR": os.path.join(tmp_dir, f"data-{port}")}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if wait:
        wait_healthy(server)
    return server


def wait_healthy(server: ServerProcess, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()[-3000:]}")


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (loaded once; tests must not modify it)."""
    from transformers import AutoTokenizer

    from gramserve.model.loader import default_tokenizer_dir

    return AutoTokenizer.from_pretrained(default_tokenizer_dir())


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server")))
    yield srv
    children = srv.child_pids()
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]
    time.sleep(0.5)
    orphans = [pid for pid in children if os.path.exists(f"/proc/{pid}") and _not_zombie(pid)]
    assert not orphans, f"child processes left behind: {orphans}"


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def model_name(base_url) -> str:
    return httpx.get(base_url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def make_async_client(base_url):
    """A factory: an AsyncOpenAI client is bound to the event loop it first runs in, so make one per loop."""
    from openai import AsyncOpenAI

    return lambda: AsyncOpenAI(base_url=base_url + "/v1", api_key="none", timeout=300, max_retries=0)


def kv_pool(base_url: str) -> dict:
    return httpx.get(base_url + "/get_server_info", timeout=10).json()["kv_pool"]


def wait_pool_whole(base_url: str, timeout: float = 20) -> dict:
    """The pool is whole when no slot is used and no request row is held."""
    deadline = time.time() + timeout
    while True:
        pool = kv_pool(base_url)
        whole = pool["used_slots"] == 0 and pool["free_request_rows"] == pool["max_running_requests"]
        if whole or time.time() > deadline:
            return pool
        time.sleep(0.2)


@pytest.fixture(scope="session")
def tight_server(tmp_path_factory):
    """A second server with small limits: a tiny KV pool, chunked prefill, a queue limit, a short compile timeout."""
    srv = start_server(
        str(tmp_path_factory.mktemp("tight")),
        "--kv-cache-memory-gb",
        "0.02",
        "--context-length",
        "512",
        "--chunked-prefill-size",
        "64",
        "--max-queued-requests",
        "6",
        "--kv-reserve-ratio",
        "0",
        "--grammar-compile-timeout",
        "1",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
