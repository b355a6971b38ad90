"""The in-process Engine (gramserve/engine.py): the same answers as the HTTP server for the same requests, batches,
streams, the async API, constraints, errors, and a clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel

from gramserve.server.errors import EngineUnavailableError, InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "max_new_tokens": 12}


class City(BaseModel):
    name: str
    population: int


@pytest.fixture(scope="module")
def engine():
    import gramserve

    eng = gramserve.Engine(skip_warmup=True)
    yield eng
    eng.shutdown()


def test_generate_answers_as_the_http_server_does(engine, base_url):
    prompt = "The three primary colors are"
    ours = engine.generate(prompt, GREEDY)
    theirs = httpx.post(f"{base_url}/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=120).json()
    assert ours["output_ids"] == theirs["output_ids"] and ours["text"] == theirs["text"]
    assert ours["meta_info"]["finish_reason"] == {"type": "length"} and ours["meta_info"]["completion_tokens"] == 12

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = engine.chat(messages, temperature=0, max_tokens=12)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    http = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=12)
    assert chat["choices"][0]["message"]["content"] == http.choices[0].message.content
    assert chat["usage"]["completion_tokens"] == http.usage.completion_tokens
    assert chat["object"] == "chat.completion" and chat["model"] == engine.model_name


def test_a_batch_keeps_the_order_and_each_prompts_params(engine):
    prompts = ["1, 2, 3,", "Monday, Tuesday,", "a, b, c,"]
    alone = [engine.generate(p, GREEDY)["text"] for p in prompts]
    batch = engine.generate(prompts, GREEDY)
    assert [b["text"] for b in batch] == alone
    lengths = [engine.generate(prompts[:2], [{"max_new_tokens": 3}, {"max_new_tokens": 5}])[i] for i in range(2)]
    assert [x["meta_info"]["completion_tokens"] for x in lengths] == [3, 5]
    ids = engine.tokenizer.encode("Hello there", add_special_tokens=False)
    by_ids = engine.generate(input_ids=[ids, ids], sampling_params=GREEDY)
    alone_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    assert by_ids[0]["output_ids"] == by_ids[1]["output_ids"] == alone_ids
    conversations = [[{"role": "user", "content": f"Say {w}."}] for w in ("yes", "no")]
    chats = engine.chat(conversations, temperature=0, max_tokens=6)
    assert [c["choices"][0]["message"]["content"] for c in chats] == [
        engine.chat(m, temperature=0, max_tokens=6)["choices"][0]["message"]["content"] for m in conversations
    ]


def test_constrained_outputs_validate(engine):
    # Greedy: sampled unseeded at the default temperature 1.0, a name could run past 64 tokens now and then.
    outs = engine.generate(
        ["Alice is 31 years old.", "Bob, 45."],
        {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 64, "temperature": 0},
    )
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    chat = engine.chat(
        [{"role": "user", "content": "The largest city in France, as JSON."}],
        response_format=City,  # a pydantic model, as the openai SDK's parse takes it
        max_tokens=48,
        temperature=1.0,
        seed=1,
    )
    choice = chat["choices"][0]
    if choice["finish_reason"] == "stop":
        City.model_validate_json(choice["message"]["content"])
    else:
        assert choice["finish_reason"] == "length"


def test_streams_end_with_the_whole_answer(engine):
    whole = engine.generate("Once upon a time", GREEDY)
    pieces = list(engine.generate("Once upon a time", GREEDY, stream=True))
    assert pieces[-1]["text"] == whole["text"] and pieces[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    assert len(pieces) > 1
    # each payload keeps the ids it had when handed out (they shared one list, which grew to the final ids)
    for p in pieces:
        assert len(p["output_ids"]) == p["meta_info"]["completion_tokens"], p
    assert pieces[-1]["output_ids"] == whole["output_ids"]

    messages = [{"role": "user", "content": "Count to five."}]
    answer = engine.chat(messages, temperature=0, max_tokens=10)["choices"][0]["message"]["content"]
    chunks = list(engine.chat(messages, temperature=0, max_tokens=10, stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == answer
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(
        c["choices"][0]["text"]
        for c in engine.completions("Once upon a time", max_tokens=12, temperature=0, stream=True)
    )
    assert text == whole["text"]


def test_a_consumer_that_falls_behind_gets_what_it_missed_in_one_output(engine):
    """The TokenizerManager hands a request's generator everything that arrived since it last ran, as one output
    (what keeps the HTTP server's event loop from falling behind under load): nothing lost, nothing repeated."""
    from gramserve.sampling.params import SamplingParams

    tm = engine.tm
    ids = tm.encode("Once upon a time")
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

    async def read(slow: bool):
        outs = []
        async for out in tm.generate(ids, params, return_logprob=True, top_logprobs=2, streamed=True):
            outs.append(out)
            if slow and len(outs) == 1:
                await asyncio.sleep(2.0)  # the engine runs on meanwhile: its outputs wait in the request's state
        return outs

    def run(slow: bool):
        return asyncio.run_coroutine_threadsafe(read(slow), engine._loop).result(120)

    fast, slow = run(False), run(True)
    for outs in (fast, slow):
        assert [t for o in outs for t in o.token_ids] == [t for o in fast for t in o.token_ids]
        assert "".join(o.text for o in outs) == "".join(o.text for o in fast)
        assert [lp.token_id for o in outs for lp in o.logprobs] == [t for o in fast for t in o.token_ids]
        assert outs[-1].completion_tokens == 24 and outs[-1].finish_reason == "length"
    assert len(slow) < len(fast) and max(len(o.token_ids) for o in slow) > 1

    async def failed_midway():
        """fail_all while outputs wait: they still go out, merged, and the failure comes after them."""
        gen = tm.generate(ids, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True), streamed=True)
        got = [await gen.__anext__()]
        await asyncio.sleep(1.5)
        tm.fail_all("the test stops the engine's requests")
        with pytest.raises(EngineUnavailableError):
            async for out in gen:
                got.append(out)
        return got

    got = asyncio.run_coroutine_threadsafe(failed_midway(), engine._loop).result(120)
    assert len(got) == 2 and len(got[1].token_ids) > 1 and got[1].finished is None


def test_the_async_api_runs_requests_together(engine):
    async def main():
        outs = await asyncio.gather(*(engine.async_generate(f"Item {i}:", GREEDY) for i in range(4)))
        stream = await engine.async_chat([{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True)
        chunks = [c async for c in stream]
        chats = await engine.async_chat([[{"role": "user", "content": "Hi"}]] * 2, max_tokens=5, temperature=0)
        done = await engine.async_completions("The sky is", max_tokens=4, temperature=0)
        return outs, chunks, chats, done

    outs, chunks, chats, done = asyncio.run(main())
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [12] * 4
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chats[0]["choices"][0]["message"]["content"] == chats[1]["choices"][0]["message"]["content"]
    assert done["usage"]["completion_tokens"] <= 4


def test_bad_requests_raise_the_routes_errors(engine):
    with pytest.raises(ValueError, match="temperature"):  # SamplingParamsError: a 400 over HTTP
        engine.chat([{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(InvalidRequestError, match="messages"):
        engine.chat([{"role": "nobody", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.generate("word " * 20000, GREEDY)
    streamed = list(engine.generate(["a", "b"], GREEDY, stream=True))  # a batch streams too, each payload indexed
    assert {p["index"] for p in streamed} == {0, 1} and all(p["text"] is not None for p in streamed)
    with pytest.raises(InvalidRequestError):
        engine.generate("x", {"json_schema": "{not json"})
    with pytest.raises(InvalidRequestError, match="2 sampling_params for 3 prompt"):
        engine.generate(["a", "b", "c"], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="unknown Engine arguments"):
        type(engine)(no_such_option=1)
    assert engine.generate("still serving", GREEDY)["meta_info"]["completion_tokens"] == 12


def test_a_stream_left_early_is_aborted(engine):
    endless = {"max_new_tokens": 4000, "ignore_eos": True}
    for i, _ in enumerate(engine.generate("Tell a long story.", endless, stream=True)):
        if i == 2:
            break
    unread = engine.generate("Another long story.", endless, stream=True)
    del unread  # dropped without reading: aborted too
    deadline = time.time() + 3
    while engine.tm.in_flight and time.time() < deadline:
        time.sleep(0.05)
    assert engine.tm.in_flight == 0


def test_shutdown_stops_the_child_processes(engine):
    procs = list(engine._procs.procs.values())
    assert procs and all(p.is_alive() for p in procs)
    running = engine.generate("A story.", {"max_new_tokens": 4000, "ignore_eos": True}, stream=True)
    next(running)
    engine.shutdown()
    with pytest.raises(Exception, match="shutting down"):  # the stream in flight ends with an error, not a hang
        list(running)
    engine.shutdown()  # twice is fine
    assert not any(p.is_alive() for p in procs)
    assert not any(os.path.exists(f"/proc/{p.pid}") and p.exitcode is None for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("x", GREEDY)
