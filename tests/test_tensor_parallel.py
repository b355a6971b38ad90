"""Tensor parallelism on the CPU: two gloo ranks serve what one rank serves.

The same server is started with --tp-size 1 and --tp-size 2 (fp32 weights on both, so that the only difference is
how the matmuls are split); greedy outputs must be equal and every sampled token's logprob and top-5 logprobs equal
within fp32 rounding. The TP=2 server then answers real clients: the openai SDK (streamed and not), a JSON schema
at temperature 1.0 (valid output), prefix-cache reuse (rank 0's slot table reaches rank 1), and its KV pool comes
back whole.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from conftest import start_server, wait_pool_whole

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colors of the rainbow:",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 12
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _generate(base_url: str) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        body = {
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 5,
        }
        r = httpx.post(base_url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


@pytest.fixture(scope="module")
def tp1_answers(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("tp1")), "--cpu-weights", "float", "--skip-warmup")
    try:
        yield _generate(srv.base_url)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory, tp1_answers):  # after the TP=1 server has stopped: two cores
    srv = start_server(str(tmp_path_factory.mktemp("tp2")), "--tp-size", "2", "--cpu-weights", "float")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_tp2_equals_tp1(tp1_answers, tp2_server):
    tp2 = _generate(tp2_server.base_url)
    for one, two in zip(tp1_answers, tp2):
        assert two["output_ids"] == one["output_ids"]
        assert two["text"] == one["text"]
        lp1, lp2 = one["meta_info"]["output_token_logprobs"], two["meta_info"]["output_token_logprobs"]
        assert [t for _, t in lp1] == [t for _, t in lp2]
        assert max(abs(a - b) for (a, _), (b, _) in zip(lp1, lp2)) < 1e-3
        for top1, top2 in zip(one["meta_info"]["output_top_logprobs"], two["meta_info"]["output_top_logprobs"]):
            first, second = dict((i, v) for v, i in top1), dict((i, v) for v, i in top2)
            common = first.keys() & second.keys()
            assert len(common) >= 4  # a near tie at the 5th place may swap
            assert max(abs(first[i] - second[i]) for i in common) < 1e-3
    info = httpx.get(tp2_server.base_url + "/get_server_info", timeout=10).json()
    assert info["runner"]["tp_size"] == 2


def test_tp2_serves_real_clients(tp2_server):
    from openai import OpenAI

    client = OpenAI(base_url=tp2_server.base_url + "/v1", api_key="none", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    resp = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=80,
        temperature=1.0,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    choice = resp.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # Streamed, twice: the second request reuses the first's cached prompt on both ranks.
    texts = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        usage = chunks[-1].usage
    assert texts[0] == texts[1] and texts[0]
    assert usage.prompt_tokens_details.cached_tokens > 0
    pool = wait_pool_whole(tp2_server.base_url)
    assert pool["used_slots"] == 0, pool


def test_two_nodes_over_loopback(tmp_path, tp1_answers, tp2_server):
    """--nnodes 2: node 1 runs only rank 1 (no HTTP server); node 0 serves, and serves what TP=1 serves."""
    import subprocess
    import sys

    from conftest import free_port

    tp2_server.stop()  # two cores: one TP=2 server at a time
    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--cpu-weights", "float"]
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "gramserve", "serve", *common, "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        node0 = start_server(str(tmp_path), *common, "--node-rank", "0", "--skip-warmup")
        try:
            answers = _generate(node0.base_url)
            assert [a["output_ids"] for a in answers] == [a["output_ids"] for a in tp1_answers]
            assert node1.poll() is None
        finally:
            assert node0.stop() == 0, node0.log()[-3000:]
        assert node1.wait(30) == 0  # rank 0 said stop: node 1 exits on its own
        text = (tmp_path / "node1.log").read_text()
        assert "node 1 ready" in text and "serving on" not in text
    finally:
        if node1.poll() is None:
            node1.kill()
