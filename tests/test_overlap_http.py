"""The overlap schedule (the GPU default) through HTTP on the CPU: a server started with `--overlap-schedule on`
answers exactly like the plain session server: greedy text and logprobs, seeded sampling, constrained JSON, tool
calls, streaming; and aborts and finished requests give their KV memory back. The overlap servers run two grammar
processes (`--grammar-shards 2`; on CUDA the default is one per two cores), the session server one, and a plain
server with two more: constrained outputs are the same whichever process holds a request's matcher."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import httpx
import jsonschema
import pytest
from conftest import start_server, wait_pool_whole

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def overlap_url(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("overlap")), "--overlap-schedule", "on", "--grammar-shards", "2")
    yield srv.base_url
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def tight_overlap_url(tmp_path_factory):
    """The overlap loop with the session's tight limits (tests/conftest.py: tight_server): retractions happen."""
    srv = start_server(
        str(tmp_path_factory.mktemp("tight-overlap")),
        "--overlap-schedule",
        "on",
        "--grammar-shards",
        "2",
        "--kv-cache-memory-gb",
        "0.02",
        "--context-length",
        "512",
        "--chunked-prefill-size",
        "64",
        "--kv-reserve-ratio",
        "0",
    )
    yield srv.base_url
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def sharded_plain_url(tmp_path_factory):
    """The plain loop (tokens reach the grammar processes as queued accepts, not through the feed) over two
    grammar processes."""
    srv = start_server(str(tmp_path_factory.mktemp("sharded-plain")), "--grammar-shards", "2")
    yield srv.base_url
    assert srv.stop() == 0, srv.log()[-3000:]


def _bodies(model: str) -> list[tuple[str, dict]]:
    chat = "/v1/chat/completions"
    ask = [{"role": "user", "content": "Name a big city and its population as JSON."}]
    return [
        (
            "/v1/completions",
            {"model": model, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "logprobs": 3},
        ),
        (
            "/v1/completions",
            {"model": model, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0.9, "seed": 11, "n": 3},
        ),
        (
            "/v1/completions",
            {"model": model, "prompt": "List: 1, 2,", "max_tokens": 30, "temperature": 0, "stop": [" 6"]},
        ),
        (
            chat,
            {
                "model": model,
                "messages": ask,
                "max_tokens": 60,
                "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
            },
        ),
        (
            chat,
            {
                "model": model,
                "messages": ask,
                "max_tokens": 60,
                "temperature": 0.7,
                "seed": 3,
                "n": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
            },
        ),
        (
            chat,
            {
                "model": model,
                "messages": [{"role": "user", "content": "Weather in Rome?"}],
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "max_tokens": 60,
                "temperature": 0,
            },
        ),
        (
            chat,
            {
                "model": model,
                "messages": [{"role": "user", "content": "A phone number?"}],
                "max_tokens": 12,
                "temperature": 0,
                "regex": r"\d{3}-\d{4}",
            },
        ),
    ]


def _strip(body: dict) -> list:
    out = []
    for c in body["choices"]:
        message = dict(c.get("message") or {})
        message["tool_calls"] = [t["function"] for t in message.get("tool_calls") or []]  # ids are random
        out.append((c.get("text"), message, c.get("finish_reason")))
    return out


def _logprobs(body: dict) -> list[float]:
    return [x for c in body["choices"] for x in ((c.get("logprobs") or {}).get("token_logprobs") or [])]


def test_same_answers_as_the_plain_schedule(base_url, overlap_url, model_name):
    async def run_all(url):
        async with httpx.AsyncClient(timeout=300) as client:
            # Sent together, so they share batches (and finish in different steps).
            rs = await asyncio.gather(*[client.post(url + path, json=body) for path, body in _bodies(model_name)])
        return [r.json() for r in rs]

    plain = asyncio.run(run_all(base_url))
    overlap = asyncio.run(run_all(overlap_url))
    for (path, body), p, o in zip(_bodies(model_name), plain, overlap):
        assert "choices" in o, o
        assert _strip(o) == _strip(p), (path, body)
        # Batches form differently under the two loops, so float sums differ in the last bits.
        assert _logprobs(o) == pytest.approx(_logprobs(p), abs=1e-3)
        # cached_tokens depends on what each server's prefix cache already holds, not on the loop.
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: o["usage"][k] for k in counts} == {k: p["usage"][k] for k in counts}
    for body in overlap[3:5]:
        for c in body["choices"]:
            jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    call = overlap[5]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city", "unit"}
    assert wait_pool_whole(overlap_url)["used_slots"] == 0
    # Under overlap the constrained rows' tokens reach the grammar process through the token feed; the plain
    # loop asks for every fill itself.
    timing = [httpx.get(u + "/get_server_info").json()["grammar_timing"] for u in (overlap_url, base_url)]
    assert timing[0]["fed_steps"] > 0 and timing[1]["fed_steps"] == 0, timing
    # Steps whose constrained rows were those of the step before reuse the rows the grammar processes already
    # have (GrammarStepReq.repeat_fed): the same answers as above came partly through that path.
    assert 0 < timing[0]["repeated_fed_steps"] < timing[0]["fed_steps"], timing
    # The constrained requests (n counts each choice) were spread over both grammar processes.
    placed = httpx.get(overlap_url + "/get_server_info").json()["grammar_requests_per_shard"]
    assert len(placed) == 2 and min(placed) >= 1, placed


def test_two_grammar_processes_answer_like_one(base_url, sharded_plain_url, model_name):
    """The plain loop with two grammar processes gives exactly the one-process answers (constrained JSON, tool
    calls, regex; n > 1 spreads one request's choices over both), and every matcher is freed afterwards."""

    async def run_all(url):
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*[client.post(url + path, json=body) for path, body in _bodies(model_name)])
        return [r.json() for r in rs]

    one, two = asyncio.run(run_all(base_url)), asyncio.run(run_all(sharded_plain_url))
    for (path, body), a, b in zip(_bodies(model_name), one, two):
        assert "choices" in b, b
        assert _strip(b) == _strip(a), (path, body)
    info = httpx.get(sharded_plain_url + "/get_server_info").json()
    assert len(info["grammar_requests_per_shard"]) == 2 and min(info["grammar_requests_per_shard"]) >= 1, info
    assert info["grammar_timing"]["fed_steps"] == 0 and info["grammar_timing"]["steps"] > 0
    assert wait_pool_whole(sharded_plain_url)["used_slots"] == 0
    info = httpx.get(sharded_plain_url + "/get_server_info").json()
    assert info["grammar_slots_in_use"] == 0 and info["grammar_live_requests"] == 0, info


def test_a_grammar_compiled_lately_runs_before_its_compile_answer(overlap_url, model_name):
    """A request whose grammar its grammar process compiled lately is admitted at once (not a step later, after the
    answer): the same valid output as the first request, which waited for the compile."""
    props = {"n": {"type": "integer"}, "s": {"type": "string"}}
    schema = {"type": "object", "properties": props, "required": ["n", "s"]}
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Give n and s as JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ns", "schema": schema}},
    }
    before = httpx.get(overlap_url + "/get_server_info").json()["grammar_admitted_early"]
    outs = []
    for _ in range(3):
        r = httpx.post(overlap_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0])
    early = httpx.get(overlap_url + "/get_server_info").json()["grammar_admitted_early"] - before
    assert early >= 1, early
    assert len({c["message"]["content"] for c in outs}) == 1
    if outs[0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(outs[0]["message"]["content"]), schema)


def test_new_grammars_park_their_logits_under_both_loops(base_url, overlap_url, model_name):
    """Requests with new grammars prefill while their grammars compile and are sampled from their saved logits once
    ready (Scheduler.parked), beside running free requests' decode steps or alone: under both loops the tokens and
    logprobs equal those of the same requests sent again, when the grammars are cached and nothing parks."""
    from uuid import uuid4

    def constrained(i: int, tag: str) -> dict:
        schema = dict(SCHEMA, **{"$comment": f"{tag}-{i}"})  # new to both servers
        return {
            "model": model_name,
            "messages": [{"role": "user", "content": f"City number {i} as JSON."}],
            "max_tokens": 30,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
            "grammar_backend": "llguidance",  # the same masks both times (auto may switch a grammar's backend)
        }

    free = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 160, "temperature": 0, "ignore_eos": True}

    async def run(url: str, bodies: list[dict]) -> list[dict]:
        """The constrained requests one at a time while two free ones decode: each arrives alone, so the step that
        takes it in prefills it while its grammar compiles (when its grammar is new), and a decode step of the free
        requests then samples its parked row."""
        async with httpx.AsyncClient(timeout=300) as client:
            frees = [asyncio.create_task(client.post(url + "/v1/completions", json=free)) for _ in range(2)]
            await asyncio.sleep(0.5)
            asks = [await client.post(url + "/v1/chat/completions", json=b) for b in bodies]
            rs = [await f for f in frees] + asks
        for r in rs:
            assert r.status_code == 200, r.text
        return [r.json()["choices"][0] for r in rs[2:]]

    def tokens(choice: dict) -> list[tuple[str, float]]:
        return [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]

    for url in (overlap_url, base_url):
        tag = uuid4().hex
        bodies = [constrained(i, tag) for i in range(4)]
        parked = httpx.get(url + "/get_server_info").json()["stats"]["parked_samples"]
        first = asyncio.run(run(url, bodies))
        assert httpx.get(url + "/get_server_info").json()["stats"]["parked_samples"] > parked
        parked = httpx.get(url + "/get_server_info").json()["stats"]["parked_samples"]
        alone = httpx.post(url + "/v1/chat/completions", json=constrained(9, tag), timeout=120).json()["choices"][0]
        assert httpx.get(url + "/get_server_info").json()["stats"]["parked_samples"] == parked + 1  # a step of its own
        again = asyncio.run(run(url, bodies)) + [
            httpx.post(url + "/v1/chat/completions", json=constrained(9, tag), timeout=120).json()["choices"][0]
        ]
        for a, b in zip(first + [alone], again):
            assert a["message"]["content"] == b["message"]["content"]
            assert [t for t, _ in tokens(a)] == [t for t, _ in tokens(b)]
            assert [lp for _, lp in tokens(a)] == pytest.approx([lp for _, lp in tokens(b)], abs=1e-3)
            if a["finish_reason"] == "stop":
                jsonschema.validate(json.loads(a["message"]["content"]), SCHEMA)
        assert wait_pool_whole(url)["used_slots"] == 0


def test_many_constrained_streams_with_disconnects(overlap_url, model_name):
    """Constrained requests that share batches, finish at different steps, and hang up with tokens in flight:
    every finished output is valid, and every grammar slot and KV slot comes back."""
    schemas = [
        SCHEMA,
        {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        {"enum": ["red", "green", "blue"]},
    ]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:

            async def complete(i):
                schema = schemas[i % len(schemas)]
                body = {
                    "model": model_name,
                    "messages": [{"role": "user", "content": f"JSON please ({i})"}],
                    "max_tokens": 40 + 7 * i,
                    "temperature": 0.8,
                    "seed": i,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                }
                r = await client.post(overlap_url + "/v1/chat/completions", json=body)
                return schema, r.json()["choices"][0]

            async def hang_up(i):
                body = {
                    "model": model_name,
                    "messages": [{"role": "user", "content": "JSON list"}],
                    "stream": True,
                    "max_tokens": 200,
                    "seed": i,
                    "response_format": {"type": "json_object"},
                }
                async with client.stream("POST", overlap_url + "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return None

            return await asyncio.gather(*[complete(i) for i in range(8)], *[hang_up(i) for i in range(4)])

    validated = 0
    for schema, choice in asyncio.run(run())[:8]:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            validated += 1
    assert validated >= 4, validated  # the short schemas (enum, boolean object) always close in time
    pool = wait_pool_whole(overlap_url, timeout=60)
    assert pool["used_slots"] == 0, pool
    info = httpx.get(overlap_url + "/get_server_info").json()
    assert info["grammar_slots_in_use"] == 0 and info["grammar_live_requests"] == 0, info


def test_streaming_and_disconnects_free_everything(overlap_url, model_name):
    body = {"model": model_name, "prompt": "Count slowly:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = httpx.post(overlap_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", overlap_url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == full

    async def hang_up():  # clients that leave mid-stream: their requests are aborted with tokens in flight
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i):
                async with client.stream(
                    "POST", overlap_url + "/v1/completions", json={**body, "max_tokens": 400, "stream": True, "seed": i}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return

            await asyncio.gather(*[one(i) for i in range(6)])

    asyncio.run(hang_up())
    pool = wait_pool_whole(overlap_url, timeout=60)
    assert pool["used_slots"] == 0 and pool["free_request_rows"] == pool["max_running_requests"], pool
    info = httpx.get(overlap_url + "/get_server_info").json()
    assert info["num_running"] == 0


def test_constrained_requests_retracted_under_overlap(tight_overlap_url, model_name):
    """More constrained work than the KV pool holds, under overlap: requests are retracted and resumed (their
    grammar slots are given up and their masks filled again), and each output is exactly what it is alone."""
    schema = {
        "type": "object",
        # Long enough outputs (whatever the backend) to outgrow the KV pool together.
        "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 12}, "minItems": 6}},
        "required": ["notes"],
    }
    url = tight_overlap_url

    def one(i):
        body = {
            "model": model_name,
            "max_tokens": 48,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Write about the number {i}. " * 6}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        }
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(one, range(6)))
    info = httpx.get(url + "/get_server_info").json()
    alone = [one(i) for i in range(6)]
    assert [c["message"]["content"] for c in together] == [c["message"]["content"] for c in alone]
    assert info["stats"]["retractions"] > 0, info["stats"]
    assert info["grammar_timing"]["fed_steps"] > 0
    for c in together:
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["message"]["content"]), schema)
    assert wait_pool_whole(url)["used_slots"] == 0
    info = httpx.get(url + "/get_server_info").json()
    assert info["grammar_slots_in_use"] == 0 and info["grammar_live_requests"] == 0, info
