"""The OpenAI API through the official SDK against the real server with the default model."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from conftest import wait_pool_whole

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_models(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert models.data[0].max_model_len == 8192


def test_chat_greedy(client, model_name):
    resp = client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=30)
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens > 20
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    again = client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=30)
    assert again.choices[0].message.content == choice.message.content


def test_chat_length_and_content_parts(client, model_name):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Write a long story about a dragon."}]}]
    resp = client.chat.completions.create(model=model_name, messages=msgs, max_tokens=5, temperature=0)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_chat_stream_matches_non_stream(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=20)
    stream = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_sse_framing(base_url, model_name):
    body = {"model": model_name, "messages": CHAT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunk = json.loads(line[6:])
        assert chunk["object"] == "chat.completion.chunk"


def test_completions_text_and_token_prompt(client, model_name, base_url):
    resp = client.completions.create(model=model_name, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    native = httpx.post(
        base_url + "/generate",
        json={"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()
    assert native["meta_info"]["prompt_tokens"] == resp.usage.prompt_tokens
    assert native["text"] == resp.choices[0].text
    by_ids = client.completions.create(
        model=model_name, prompt=native["output_ids"][:0] + [504, 2365], max_tokens=4, temperature=0
    )
    assert by_ids.usage.prompt_tokens == 2 and by_ids.usage.completion_tokens == 4


def test_completions_batch_prompts_and_stream(client, model_name):
    resp = client.completions.create(model=model_name, prompt=["One, two,", "Red, green,"], max_tokens=6, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    single = client.completions.create(model=model_name, prompt="Red, green,", max_tokens=6, temperature=0)
    assert resp.choices[1].text == single.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_name, prompt="Red, green,", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == single.choices[0].text
    # Several prompts stream together (as OpenAI): choices numbered by prompt, then by n; usage sums them.
    prompts = ["One, two,", "Red, green,"]
    whole = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=6, temperature=0)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        model=model_name,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices} and sorted(texts) == [0, 1, 2, 3]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_client_leaving_a_stream_of_several_prompts_leaks_nothing(base_url, model_name):
    # 3 x 3,000 tokens would take tens of seconds here: the pool is whole within 5 s only if they were aborted.
    body = {"model": model_name, "prompt": ["One,", "Two,", "Three,"], "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 4:
                break  # the connection closes here, the three requests still running
    assert wait_pool_whole(base_url, timeout=5)["used_slots"] == 0


def test_n_choices(client, model_name):
    resp = client.chat.completions.create(model=model_name, messages=CHAT, n=4, temperature=1.0, max_tokens=12, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    texts = {c.message.content for c in resp.choices}
    assert len(texts) > 1, "sampled choices with different seeds should differ"
    assert resp.usage.completion_tokens <= 4 * 12
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, n=3, temperature=1.0, max_tokens=8, seed=7, stream=True
    )
    per_choice: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            per_choice[ch.index] = per_choice.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(per_choice) == [0, 1, 2]
    # A sweep over seeds gives new samples: choice 1 of seed 7 is not choice 0 of seed 8 (a new user's finding,
    # when choice i took seed + i).
    seven, eight = (
        client.chat.completions.create(model=model_name, messages=CHAT, n=2, temperature=1.0, max_tokens=12, seed=s)
        for s in (7, 8)
    )
    assert seven.choices[1].message.content != eight.choices[0].message.content


def test_seed_reproducibility(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=1.0,
        top_p=0.95,
        max_tokens=24,
    )
    a = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kwargs).choices[0].message.content
    c = client.chat.completions.create(seed=999, **kwargs).choices[0].message.content
    assert a == b
    assert a != c


def test_stop_strings(client, model_name, base_url):
    base = client.completions.create(model=model_name, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert " 8" in text, text
    resp = client.completions.create(
        model=model_name, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0, stop=[" 8", "never"]
    )
    assert resp.choices[0].text == text[: text.index(" 8")]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_name, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0, stop=" 8", stream=True
        )
        if c.choices
    )
    assert streamed == resp.choices[0].text
    # A stop string spanning several tokens.
    resp2 = client.completions.create(
        model=model_name, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0, stop=[", 9,"]
    )
    assert ", 9," not in resp2.choices[0].text and resp2.choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output (SGLang's no_stop_trim on /generate): the text ends with the stop string
    kept = client.completions.create(
        model=model_name,
        prompt="1, 2, 3, 4, 5, 6,",
        max_tokens=12,
        temperature=0,
        stop=[", 9,"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == resp2.choices[0].text + ", 9," and kept.choices[0].finish_reason == "stop"
    streamed_kept = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_name,
            prompt="1, 2, 3, 4, 5, 6,",
            max_tokens=12,
            temperature=0,
            stop=[", 9,"],
            stream=True,
            extra_body={"include_stop_str_in_output": True},
        )
        if c.choices
    )
    assert streamed_kept == kept.choices[0].text
    native = httpx.post(
        base_url + "/generate",
        json={
            "text": "1, 2, 3, 4, 5, 6,",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": [", 9,"], "no_stop_trim": True},
        },
        timeout=60,
    ).json()
    assert native["text"].endswith(", 9,"), native


def test_stop_token_ids_and_ignore_eos(client, model_name):
    resp = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"
    resp = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=20, temperature=0, extra_body={"min_tokens": 15}
    )
    assert resp.usage.completion_tokens >= 15


def test_logprobs(client, model_name):
    resp = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0
        assert len(tok.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-5)
        assert [t.logprob for t in tok.top_logprobs] == sorted((t.logprob for t in tok.top_logprobs), reverse=True)
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    comp = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    # As OpenAI: the sampled token is always among them (up to logprobs + 1 entries); logprobs 0 gives it alone.
    hot = client.completions.create(model=model_name, prompt="Hello", max_tokens=6, temperature=1.5, logprobs=0, seed=1)
    lp = hot.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs


def test_logit_bias(client, model_name, base_url):
    ids = httpx.post(
        base_url + "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "logit_bias": {"28": 100}}},
    ).json()
    assert ids["output_ids"] == [28] * 5
    resp = client.completions.create(
        model=model_name, prompt="Hello", max_tokens=5, temperature=0, logit_bias={"28": 100}, logprobs=0
    )
    assert resp.choices[0].text == ids["text"]
    banned = client.completions.create(model=model_name, prompt="1, 2, 3,", max_tokens=1, temperature=0)
    first = httpx.post(
        base_url + "/generate", json={"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    ).json()["output_ids"][0]
    alt = client.completions.create(
        model=model_name, prompt="1, 2, 3,", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert alt.choices[0].text != banned.choices[0].text


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 100000}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ],
)
def test_bad_parameters_are_400(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=CHAT, **kwargs)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body


def test_wrong_types_and_bad_json_are_400(base_url, model_name):
    r = httpx.post(
        base_url + "/v1/chat/completions", json={"model": model_name, "messages": CHAT, "temperature": "hot"}
    )
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/chat/completions", json={"model": model_name, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        base_url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/completions", json={"model": model_name, "prompt": [10**9]})
    assert r.status_code == 400
    r = httpx.post(base_url + "/generate", json={"text": "hi", "sampling_params": {"temprature": 1}})
    assert r.status_code == 400 and "temprature" in r.json()["error"]["message"]
    r = httpx.post(
        base_url + "/v1/chat/completions", json={"model": model_name, "messages": CHAT, "unknown_x": 1, "max_tokens": 2}
    )
    assert r.status_code == 200  # unknown fields are ignored, like OpenAI-compatible servers do


def test_null_is_the_default(base_url, model_name):
    """OpenAI marks its optional fields nullable, and clients and proxies send nulls: each stands for the default."""
    nulls = ("n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "parallel_tool_calls", "min_tokens")
    body = {"model": model_name, "messages": CHAT, "max_tokens": 2, **dict.fromkeys(nulls)}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "n": None, "echo": None, "stream": None}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(base_url + "/v1/chat/completions", json={"model": model_name, "messages": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_chat_template_kwargs_that_name_the_call_s_own_arguments(base_url, model_name):
    """vLLM's add_generation_prompt / continue_final_message are taken from chat_template_kwargs too; a key that
    names an argument of the template call itself is a 400 (it was a 500)."""
    body = {"model": model_name, "messages": CHAT, "max_tokens": 2}
    plain = httpx.post(base_url + "/v1/chat/completions", json={**body, "add_generation_prompt": False}, timeout=60)
    kwarg = {**body, "chat_template_kwargs": {"add_generation_prompt": False}}
    r = httpx.post(base_url + "/v1/chat/completions", json=kwarg, timeout=60)
    assert r.status_code == plain.status_code == 200 and r.json()["usage"] == plain.json()["usage"], r.text
    for key in ("messages", "conversation", "tokenize", "self"):
        r = httpx.post(base_url + "/v1/chat/completions", json={**body, "chat_template_kwargs": {key: 1}}, timeout=60)
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], (key, r.text)
        assert r.headers.get("x-request-id")


@pytest.mark.parametrize(
    "path,body,param,fragment",
    [
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when stream is true",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ("/v1/chat/completions", {"messages": []}, "messages", "must not be empty"),
        ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 0},
            "max_completion_tokens",
            "max_completion_tokens must be at least 1",
        ),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs", "[0, 5]"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "not supported"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of", "greater than or equal to n"),
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "not supported"),
        ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix", "not supported"),
        ("/v1/completions", {"prompt": ""}, "prompt", "empty"),
        (
            "/v1/completions",
            {"prompt": ["One,", "hello " * 9000]},
            "prompt",
            "context length",
        ),  # any prompt fails all
        ("/generate", {"text": "hi", "input_ids": [504]}, "text", "exactly one"),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}, "text", "exactly one"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature", "in [0, 100]"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
            "min_new_tokens",
            "min_new_tokens must not exceed max_new_tokens",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"abc": 1}}}, "logit_bias", "token ids"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 100000}}, "max_tokens", "context length"),
        ("/generate", {"input_ids": [10**9]}, "prompt", "vocabulary"),
    ],
)
def test_request_rules_are_400(base_url, model_name, path, body, param, fragment):
    r = httpx.post(base_url + path, json={"model": model_name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"], err


def test_max_completion_tokens_wins_over_max_tokens(client, model_name):
    resp = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=10, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 3


def test_native_and_openai_sample_alike(client, model_name, base_url):
    """/generate and /v1/completions build their sampling params the same way (SGLang's names on /generate)."""
    native = httpx.post(
        base_url + "/generate",
        timeout=60,
        json={
            "text": "Once upon a time",
            "sampling_params": {
                "max_new_tokens": 12,
                "min_new_tokens": 2,
                "temperature": 0.9,
                "top_k": 0,
                "sampling_seed": 21,
                "stop": ".",
            },
        },
    )
    assert native.status_code == 200, native.text
    resp = client.completions.create(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0.9,
        seed=21,
        stop=".",
        extra_body={"top_k": 0, "min_tokens": 2},
    )
    assert native.json()["text"] == resp.choices[0].text


def test_native_duplicate_rid_and_abort_request(base_url):
    rid = "test-native-rid"
    body = {
        "text": "Count:",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as s:
        lines = s.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        dup = httpx.post(base_url + "/generate", json={**body, "stream": False}, timeout=60)
        assert dup.status_code == 400 and dup.json()["error"]["param"] == "rid", dup.text
        r = httpx.post(base_url + "/abort_request", json={"rid": rid}, timeout=10)
        assert r.status_code == 200 and r.json() == {"rid": rid}
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 3000
    r = httpx.post(base_url + "/abort_request", json={"rid": rid}, timeout=10)
    assert r.status_code == 200 and r.json() == {"rid": rid}  # the same answer: it does not tell which rids exist
    for bad in ({}, {"rid": ["a"]}, {"rid": 5}):
        r = httpx.post(base_url + "/abort_request", json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    r = httpx.post(base_url + "/abort_request", timeout=10)  # no body
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert wait_pool_whole(base_url)["used_slots"] == 0


def test_abort_request_by_a_rid_the_requests_split_from_it(base_url):
    """n > 1 and batches run as several requests (rid-0, rid-1, ...): /abort_request with the client's rid aborts
    them all (before, nothing: they ran to max_new_tokens). A batch the waiting queue could never hold is a 400."""
    sampling = {"max_new_tokens": 2000, "n": 2, "ignore_eos": True}
    body = {"rid": "split-rid", "text": "Count:", "sampling_params": sampling}

    def abort_soon():
        time.sleep(1.0)
        httpx.post(base_url + "/abort_request", json={"rid": "split-rid"}, timeout=10)

    aborter = threading.Thread(target=abort_soon)
    aborter.start()
    r = httpx.post(base_url + "/generate", json=body, timeout=120)
    aborter.join()
    assert r.status_code == 200, r.text
    assert [x["meta_info"]["finish_reason"]["type"] for x in r.json()] == ["abort", "abort"]
    assert all(x["meta_info"]["completion_tokens"] < 2000 for x in r.json())
    many = {"text": ["a"] * 17, "sampling_params": {"max_new_tokens": 1, "n": 128}}
    r = httpx.post(base_url + "/generate", json=many, timeout=60)
    assert r.status_code == 400 and "waiting queue" in r.json()["error"]["message"], r.text
    from gramserve.server import protocol as P
    from gramserve.server.native_batch import split_generate

    assert len(split_generate(P.GenerateRequest(text="hi"), 8, 0)[0]) == 1  # --max-queued-requests 0: no limit
    assert wait_pool_whole(base_url)["used_slots"] == 0


def test_context_length_error(client, model_name):
    long_prompt = "hello " * 9000
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt=long_prompt, max_tokens=5)
    assert "context length" in err.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=CHAT)
    assert err.value.body["code"] == "model_not_found"
    r = httpx.get(str(client.base_url).rstrip("/").removesuffix("/v1") + "/no/such/route")
    assert r.status_code == 404 and "error" in r.json()


def test_native_generate(base_url):
    r = httpx.post(
        base_url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    )
    body = r.json()
    assert r.status_code == 200 and body["meta_info"]["completion_tokens"] == 6
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    chunks = []
    with httpx.stream(
        "POST",
        base_url + "/generate",
        json={
            "input_ids": body["output_ids"],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "stream": True,
        },
        timeout=60,
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks[-1]["meta_info"]["completion_tokens"] == 4
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(len(chunks) - 1))


def _sse_payloads(base_url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base_url + "/generate", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_native_generate_batches(base_url):
    """SGLang's batched /generate: a list of texts or id lists (one sampling_params or one per prompt, rids per
    prompt), and sampling_params.n; answers in prompt order then sample order, each alike to its single request;
    streamed payloads carry their index. A generated rid is reported as meta_info.id (it can be aborted)."""
    greedy = {"max_new_tokens": 5, "temperature": 0}
    texts = ["The capital of France is", "One, two,"]
    singles = [httpx.post(base_url + "/generate", json={"text": t, "sampling_params": greedy}).json() for t in texts]
    assert all(len(s["meta_info"]["id"]) >= 16 for s in singles)
    r = httpx.post(base_url + "/generate", json={"text": texts, "sampling_params": greedy, "rid": ["a", "b"]})
    assert r.status_code == 200
    batch = r.json()
    assert [b["text"] for b in batch] == [s["text"] for s in singles]
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b"]
    ids = [s["output_ids"] for s in singles]
    per_prompt = [greedy, {**greedy, "max_new_tokens": 2}]
    by_ids = httpx.post(base_url + "/generate", json={"input_ids": ids, "sampling_params": per_prompt}).json()
    assert [b["meta_info"]["completion_tokens"] for b in by_ids] == [5, 2]
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    three = httpx.post(base_url + "/generate", json={"text": texts[0], "sampling_params": sampled}).json()
    assert len(three) == 3 and len({t["text"] for t in three}) > 1  # seed 7 and two derived from it
    again = httpx.post(base_url + "/generate", json={"text": texts[0], "sampling_params": sampled}).json()
    assert [t["text"] for t in again] == [t["text"] for t in three]
    payloads = _sse_payloads(base_url, {"text": texts, "sampling_params": greedy})
    assert {p["index"] for p in payloads} == {0, 1}
    last = {p["index"]: p["text"] for p in payloads}
    assert [last[0], last[1]] == [s["text"] for s in singles]
    for body, param in (
        ({"text": texts, "sampling_params": [greedy]}, "sampling_params"),
        ({"text": texts, "rid": ["a"]}, "rid"),
        ({"text": []}, "text"),
        ({"text": "hi", "sampling_params": {"n": 0}}, "n"),
        ({"text": ["hi", "hello " * 9000], "sampling_params": greedy}, "prompt"),  # one bad prompt fails the batch
    ):
        r = httpx.post(base_url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_client_disconnect_aborts_and_frees_kv(base_url, model_name):
    body = {"model": model_name, "messages": CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    # Non-streaming client that gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            base_url + "/v1/completions",
            json={"model": model_name, "prompt": "Go", "max_tokens": 3000, "ignore_eos": True},
            timeout=1.5,
        )
    pool = wait_pool_whole(base_url, timeout=30)
    assert pool["used_slots"] == 0, pool
    info = httpx.get(base_url + "/get_server_info").json()
    assert info["num_running"] == 0 and info["num_waiting"] == 0


def test_server_info(base_url):
    info = httpx.get(base_url + "/get_server_info").json()
    assert info["runner"]["architecture"] == "LlamaForCausalLM"
    assert info["kv_pool"]["total_slots"] > 8192
    assert info["server_args"]["port"] > 0


def test_sse_events_survive_splitlines():
    """U+2028/U+2029/U+0085 in generated text are escaped in stream events: clients that split the stream with
    str.splitlines (httpx's aiter_lines) got half an event (a JSONDecodeError, seen in a GPU benchmark run)."""
    from pydantic import BaseModel

    from gramserve.server.streaming import sse

    class Chunk(BaseModel):
        text: str

    for event in (sse(Chunk(text="a\u2028b\x85c\u2029d é")), sse({"text": "a\u2028b"})):
        data_line, blank = event.splitlines()
        assert blank == "" and data_line.startswith("data: ")
        assert json.loads(data_line[6:])["text"].startswith("a\u2028b")


def test_browsers_may_call_the_api_and_audio_is_refused(base_url, model_name):
    """CORS as vLLM and SGLang answer it by default (a preflight got a 405, so browser clients could not call the
    API); a request for audio output got a 200 with text only."""
    headers = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    headers["Access-Control-Request-Headers"] = "authorization"
    pre = httpx.options(base_url + "/v1/chat/completions", headers=headers)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://app.example"), pre
    got = httpx.get(base_url + "/v1/models", headers={"Origin": "http://app.example"})
    assert got.status_code == 200 and "access-control-allow-origin" in got.headers
    body = {"model": model_name, "messages": CHAT, "max_tokens": 2}
    for extra in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy", "format": "wav"}}):
        r = httpx.post(base_url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and "audio" in r.json()["error"]["message"], r.text
    r = httpx.post(base_url + "/v1/chat/completions", json={**body, "modalities": ["text"]}, timeout=60)
    assert r.status_code == 200, r.text


def test_abort_request_by_the_response_id_the_client_sees(base_url, model_name):
    """/abort_request with an OpenAI response's `id` (chatcmpl-..., or built from the client's X-Request-Id) aborts
    every choice of it (a new user's finding: only the internal `<id>-0` worked, so the stream ran to the end)."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        lines = (line for line in s.iter_lines() if line.startswith("data: {"))
        first = json.loads(next(lines)[6:])
        r = httpx.post(base_url + "/abort_request", json={"rid": first["id"]}, timeout=10)
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in lines]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    finishes = [f for f in finishes if f]
    assert finishes and finishes[-1] == "abort"

    def abort_soon():
        time.sleep(1.5)
        httpx.post(base_url + "/abort_request", json={"rid": "chatcmpl-mine-42"}, timeout=10)

    aborter = threading.Thread(target=abort_soon)
    aborter.start()
    t = time.monotonic()
    r = httpx.post(
        base_url + "/v1/chat/completions", json={**body, "n": 2}, headers={"X-Request-Id": "mine-42"}, timeout=120
    )
    aborter.join()
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-mine-42", r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["abort", "abort"]
    assert r.json()["usage"]["completion_tokens"] < 2 * 3000 and time.monotonic() - t < 60
    assert wait_pool_whole(base_url)["used_slots"] == 0
