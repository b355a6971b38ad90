"""Data parallelism: a controller routes requests over --dp-size replicas; a replica that dies fails only its own
requests and the others keep serving.

The routing policies are checked on the controller's Router directly (no process needed); the rest runs a real
two-replica server and speaks HTTP to it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import start_server, wait_pool_whole

from gramserve.messages import SamplingParams, TokenizedGenerateReq
from gramserve.scheduler.dp_controller import AFFINITY_SLACK, Router, merge_replies


def _req(rid: str, ids: list[int]) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, ids, SamplingParams())


def test_round_robin_alternates_over_live_replicas():
    router = Router(3, "round_robin")
    assert [router.route(_req(f"r{i}", [1])) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert sorted(router.down(1)) == ["r1", "r4"]
    assert {router.route(_req(f"s{i}", [1])) for i in range(4)} == {0, 2}


def test_shortest_queue_follows_what_ended():
    router = Router(2, "shortest_queue")
    assert [router.route(_req(f"r{i}", [1])) for i in range(4)] == [0, 1, 0, 1]
    router.ended(1, ["r1", "r3"])  # replica 1 is idle again
    assert router.route(_req("r4", [1])) == 1
    assert router.route(_req("r5", [1])) == 1
    assert router.route(_req("r6", [1])) == 0


def test_prefix_affinity_sticks_until_the_replica_is_much_busier():
    router = Router(2, "prefix_affinity")
    system = list(range(100, 140))
    first = router.route(_req("a0", system + [1]))
    # Requests that start alike follow the first, while its load stays within the slack of the other's.
    same = [router.route(_req(f"a{i}", system + [i])) for i in range(1, AFFINITY_SLACK + 1)]
    assert set(same) == {first}
    assert router.route(_req("b", system + [7, 7])) == 1 - first  # now too busy: the other replica
    assert router.route(_req("c", list(range(500, 540)))) == 1 - first  # another prefix: the least loaded


def test_merged_server_info_adds_counts():
    one = {"kv_pool": {"used_slots": 3, "max_running_requests": 8}, "num_running": 1, "runner": {"tp_size": 1}}
    two = {"kv_pool": {"used_slots": 2, "max_running_requests": 8}, "num_running": 2, "runner": {"tp_size": 1}}
    merged = merge_replies("server_info", {0: one, 1: two}, 2)
    assert merged["kv_pool"] == {"used_slots": 5, "max_running_requests": 16}
    assert merged["num_running"] == 3 and merged["runner"] == {"tp_size": 1}
    assert merged["data_parallel"]["alive"] == [0, 1]
    assert merge_replies("flush_cache", {0: {"ok": True}, 1: {"error": "busy"}}, 2) == {"error": "busy"}


def _chat(base_url: str, content: str, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    body.update(temperature=0, **extra)
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)


def test_two_replicas_serve_and_one_dies_alone(tmp_path):
    srv = start_server(str(tmp_path), "--dp-size", "2", "--load-balance-method", "round_robin",
                       "--served-model-name", "m")  # fmt: skip
    try:
        warm = httpx.get(srv.base_url + "/get_server_info", timeout=10).json()["data_parallel"]["replicas"]
        assert [r["stats"]["forward_steps"] > 0 for r in warm] == [True, True]  # the warm-up ran on both
        from openai import OpenAI

        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none", timeout=300, max_retries=0)
        prompts = [f"Count from {i} to {i + 5}." for i in range(6)]

        def ask(prompt: str) -> str:
            resp = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
            )
            return resp.choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, prompts))
        assert all(answers)
        assert ask(prompts[0]) == answers[0]  # the other replica (round robin) answers the same
        info = httpx.get(srv.base_url + "/get_server_info", timeout=10).json()
        replicas = info["data_parallel"]["replicas"]
        finished = [r["stats"]["requests_finished"] - w["stats"]["requests_finished"] for r, w in zip(replicas, warm)]
        assert finished == [4, 3]  # seven requests, round robin (the warm-up is pinned, outside the turn)
        assert wait_pool_whole(srv.base_url)["used_slots"] == 0

        # Long requests on both replicas; replica 1's scheduler is killed while they run.
        results: dict[int, httpx.Response] = {}

        def long(i: int) -> None:
            results[i] = _chat(srv.base_url, f"Write a long story number {i}.", 400, ignore_eos=True)

        threads = [threading.Thread(target=long, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        time.sleep(2.0)
        os.kill(replicas[1]["pid"], signal.SIGKILL)
        for t in threads:
            t.join(120)
        codes = sorted(r.status_code for r in results.values())
        assert codes == [200, 200, 503, 503], [r.text[:200] for r in results.values()]
        failed = next(r for r in results.values() if r.status_code == 503)
        assert "replica" in failed.json()["error"]["message"]

        # The server still serves, on replica 0 alone.
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        assert ask(prompts[1]) == answers[1]
        info = httpx.get(srv.base_url + "/get_server_info", timeout=10).json()
        assert info["data_parallel"]["alive"] == [0]
        assert wait_pool_whole(srv.base_url)["used_slots"] == 0
        assert "replica 1 stops, the others serve" in srv.log()
        assert "tensor parallel 1 x data parallel 2 (round_robin)" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
