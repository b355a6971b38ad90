"""The warm-up (server/warmup.py): /health answers 503 "warming up" until every case ran, then 200; the log says
what ran and how long it took; --skip-warmup turns it off; warm-up requests are not counted in /metrics."""

from __future__ import annotations

import time

import httpx
from conftest import start_server, wait_healthy

from gramserve.server.health import ServerHealth
from gramserve.server.warmup import warmup_cases


def test_health_is_warming_until_the_cases_ran(tmp_path):
    server = start_server(str(tmp_path), wait=False)
    try:
        seen = []
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                r = httpx.get(server.base_url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()["error"]["message"] if r.status_code != 200 else ""))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1][0] == 200
        assert (503, "the server is warming up") in seen, seen[:5]
        log = server.log()
        assert "warm-up done in" in log and "JSON schema" in log
        metrics = httpx.get(server.base_url + "/metrics").text
        counted = [
            line
            for line in metrics.splitlines()
            if line.startswith(("gramserve:prompt_tokens_total", "gramserve:request_success_total"))
        ]
        assert counted and all(line.endswith(" 0.0") for line in counted), counted  # warm-up requests: not counted
    finally:
        server.stop()


def test_skip_warmup(tmp_path):
    server = start_server(str(tmp_path), "--skip-warmup", wait=False)
    try:
        wait_healthy(server)
        assert "warm-up done" not in server.log()
    finally:
        server.stop()


def test_warming_refuses_all_but_warmup_requests():
    health = ServerHealth(None, 60.0, warming=True)
    assert health.problem() == "the server is warming up"
    assert health.problem(warmup_request=True) is None
    health.warming = False
    assert health.problem() is None


def test_gpu_cases_cover_every_path():
    names = " ".join(c.name for c in warmup_cases("cuda", 8192, 8192, 1024))
    paths = ("cached prefix", "decode batch 128", "top-k", "seeded", "penalties", "logprobs", "JSON", "regex", "long")
    for path in paths:
        assert path in names
