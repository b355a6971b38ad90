"""Constrained generation through HTTP with the default model: every output parses and validates."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from decimal import Decimal
from pathlib import Path
from uuid import uuid4

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpora" / "jsonschemabench-dev"
PROMPT = "Return a JSON document that matches this JSON schema. Schema:\n{schema}"


class Person(BaseModel):
    name: str
    age: int
    hobbies: list[str] = Field(max_length=3)  # a 135M model at temperature 0 would list forever


def test_parse_with_pydantic_model(client, model_name):
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a person named Ada, aged 36."}],
        response_format=Person,
        max_tokens=200,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    person = choice.message.parsed
    assert isinstance(person, Person)
    assert Person.model_validate_json(choice.message.content) == person


def test_json_object_and_schema_variants(base_url, model_name):
    for rf in (
        {"type": "json_object"},
        {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "strict": False,
                "schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
                    "required": ["city", "population"],
                },
            },
        },
    ):
        r = httpx.post(
            base_url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": model_name,
                "messages": [{"role": "user", "content": "Give me a city as JSON."}],
                "response_format": rf,
                "max_tokens": 120,
                "temperature": 0,
            },
        )
        body = r.json()
        assert r.status_code == 200, body
        assert body["grammar_backend"] in ("xgrammar", "llguidance")
        value = json.loads(body["choices"][0]["message"]["content"])
        assert isinstance(value, dict)
        if rf["type"] == "json_schema":
            jsonschema.validate(value, rf["json_schema"]["schema"])


def test_regex_ebnf_choice(client, model_name, base_url):
    pattern = r"\d{3}-\d{4}"
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "A phone number?"}],
        max_tokens=20,
        temperature=0,
        extra_body={"regex": pattern},
    )
    assert re.fullmatch(pattern, r.choices[0].message.content)
    ebnf = 'root ::= "The answer is " ("yes" | "no") "."'
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Is it raining?"}],
        max_tokens=20,
        temperature=0,
        extra_body={"ebnf": ebnf},
    )
    assert r.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    choices = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "I love it!"}],
            max_tokens=10,
            temperature=0.8,
            seed=1,
            extra_body=body,
        )
        assert r.choices[0].message.content in choices
    gen = httpx.post(
        base_url + "/generate",
        timeout=60,
        json={"text": "Answer: ", "sampling_params": {"max_new_tokens": 10, "regex": "(yes|no)"}},
    ).json()
    assert gen["text"] in ("yes", "no") and gen["meta_info"]["finish_reason"]["type"] == "stop"
    comp = client.completions.create(
        model=model_name,
        prompt="Numbers: ",
        max_tokens=40,
        temperature=0,
        extra_body={"regex": "[0-9]{1,3}(, [0-9]{1,3}){2}"},
    )
    assert re.fullmatch("[0-9]{1,3}(, [0-9]{1,3}){2}", comp.choices[0].text)
    assert comp.choices[0].finish_reason == "stop"


def test_streaming_constrained(client, model_name):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=50,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_other_backends_per_request(client, model_name, backend):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    ask = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Name and a number, as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"grammar_backend": backend},
    )
    r = client.chat.completions.create(**ask)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.model_extra["grammar_backend"] == backend
    # A stream says it on the choice's last chunk (it never did before).
    chunks = list(client.chat.completions.create(**ask, stream=True))
    last = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert last.model_extra["grammar_backend"] == backend
    assert all(c.model_extra.get("grammar_backend") is None for c in chunks if c is not last)


def test_auto_falls_back(base_url, model_name):
    # outlines-core has no EBNF: with `auto` the request is served by a backend that does.
    r = httpx.post(
        base_url + "/v1/completions",
        timeout=60,
        json={
            "model": model_name,
            "prompt": "x",
            "max_tokens": 5,
            "ebnf": 'root ::= "ok"',
            "grammar_backend": "outlines",
        },
    )
    assert r.status_code == 400 and "outlines" in r.json()["error"]["message"]
    r = httpx.post(
        base_url + "/v1/completions",
        timeout=60,
        json={"model": model_name, "prompt": "x", "max_tokens": 5, "ebnf": 'root ::= "ok"', "grammar_backend": "auto"},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"


def _schema_body(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}


@pytest.mark.parametrize(
    "body,fragment",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{not json"}}},
            "not valid JSON",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}}, ""),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "not supported"),
        ({"regex": "(unclosed"}, ""),
        ({"ebnf": "root ::= missing_rule"}, ""),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
        ({"guided_choice": []}, "non-empty"),
        ({"grammar_backend": "nope", "regex": "a"}, "grammar_backend"),
        # Schemas no backend can serve (grammar/schema_checks.py): before, each was served and ended "stop" or
        # "invalid_output" with an output that broke it, or unchecked.
        (_schema_body({"type": []}), "invalid at /type"),
        (_schema_body({"enum": []}), "empty enum"),
        (_schema_body({"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}), "/properties/a"),
        (_schema_body({"type": "object", "required": "a"}), "invalid at /required"),
        (_schema_body({"type": "number", "multipleOf": -3}), "invalid at /multipleOf"),
        (_schema_body({"type": "integer", "minimum": 10**30, "maximum": 10**31}), "64-bit"),
        (_schema_body({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "itself"),
        (_schema_body({"type": "string", "enum": [1, 2]}), "no value satisfies"),
        # three unique integers in 0..1: ran to max_tokens
        (
            _schema_body(
                {
                    "type": "array",
                    "uniqueItems": True,
                    "minItems": 3,
                    "items": {"type": "integer", "minimum": 0, "maximum": 1},
                }
            ),
            "3 unique items drawn from 2",
        ),
        ({"ebnf": 'root ::= root "a"', "grammar_backend": "xgrammar"}, "allows no output"),  # was a 500
        ({"regex": r"[^\s\S]"}, "allows no output"),
    ],
)
def test_bad_constraints_are_400(base_url, model_name, body, fragment):
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=60,
        json={"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body},
    )
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    # and the same through streaming: still a clean 400 before the stream starts
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            **body,
        },
    )
    assert r.status_code == 400


@pytest.mark.parametrize("extra", [{"min_tokens": 40}, {"ignore_eos": True}])
def test_a_constrained_output_ends_at_its_eos_whatever_min_tokens_and_ignore_eos_say(base_url, model_name, extra):
    """The grammar allows EOS only where the output is complete; a new user saw `{"ok": true}` padded with EOS
    tokens up to min_tokens (completion_tokens 40), or run to max_tokens under ignore_eos."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Is it ok?"}],
        "max_tokens": 60,
        "temperature": 0,
        **_schema_body({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
        **extra,
    }
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"])["ok"] in (True, False)
    assert usage["completion_tokens"] < 20, usage


def test_top_logprobs_of_constrained_outputs_list_only_allowed_tokens(base_url, model_name):
    """Alternatives the grammar masked out have logprob -inf: they are not listed (a row may list fewer than asked).
    Before, the JSON encoding of -inf failed the response with a 500 (and streams listed them with null)."""
    choice = ["yes", "no"]
    ask = [{"role": "user", "content": "hi"}]
    chat = {"model": model_name, "messages": ask, "max_tokens": 5, "guided_choice": choice, "logprobs": True}
    for stream in (False, True):
        body = {**chat, "top_logprobs": 5, "stream": stream}
        r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            lps = [ch.get("logprobs") or {} for e in events for ch in e["choices"]]
            content = [c for lp in lps for c in lp.get("content") or []]
        else:
            content = r.json()["choices"][0]["logprobs"]["content"]
            # The EOS that ended the answer is not part of it: neither its text nor its logprob (as OpenAI).
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            assert "".join(c["token"] for c in content) == r.json()["choices"][0]["message"]["content"]
        assert content
        for entry in content:
            assert entry["top_logprobs"] and all(t["logprob"] is not None for t in entry["top_logprobs"]), entry
            assert all(t["logprob"] > -1e30 for t in entry["top_logprobs"])
        # The first token is "y" or "n" (or a longer prefix of an answer): every alternative starts an answer.
        assert all(any(c.startswith(t["token"]) for c in choice) for t in content[0]["top_logprobs"]), content[0]
    comp = {"model": model_name, "prompt": "hi", "max_tokens": 5, "guided_choice": choice, "logprobs": 3}
    r = httpx.post(base_url + "/v1/completions", json=comp, timeout=60)
    assert r.status_code == 200, r.text
    assert all(len(top) <= 4 for top in r.json()["choices"][0]["logprobs"]["top_logprobs"])  # 3 + the sampled one
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 5, "choice": choice}, "return_logprob": True}
    r = httpx.post(base_url + "/generate", json={**native, "top_logprobs_num": 3}, timeout=60)
    assert r.status_code == 200, r.text
    # SGLang's return_text_in_logprobs: [logprob, id, text]; prompt logprobs are not served (a 400, not ignored)
    r = httpx.post(base_url + "/generate", json={**native, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = r.json()["meta_info"]
    assert "".join(e[2] for e in meta["output_token_logprobs"]).startswith(r.json()["text"]), meta
    assert all(len(e) == 3 for top in meta["output_top_logprobs"] for e in top)
    r = httpx.post(base_url + "/generate", json={**native, "logprob_start_len": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len", r.text


def test_logprob_bytes_of_tokens_holding_part_of_a_character(base_url, model_name):
    """A token may hold part of a character: its `bytes` are its own (an emoji's first bytes), not the replacement
    character's, so the bytes of the answer's tokens joined are the answer (OpenAI's reason to list them)."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Party!"}],
        "max_tokens": 10,
        "guided_choice": ["\U0001f389\U0001f600 caf\u00e9"],
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert any(c["token"] == "\ufffd" for c in content), "the emoji should take tokens of partial characters"
    assert bytes(b for c in content for b in c["bytes"]).decode() == choice["message"]["content"]
    assert choice["message"]["content"] == "\U0001f389\U0001f600 caf\u00e9"
    # The completions API: such tokens are written bytes:\\xNN..., and each text_offset is where its character starts.
    body = {"model": model_name, "prompt": "Party!", "max_tokens": 10, "guided_choice": body["guided_choice"]}
    body["temperature"] = 0  # one tokenization of the choice for both requests below
    r = httpx.post(base_url + "/v1/completions", json={**body, "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    text, lp = r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]
    assert text == "\U0001f389\U0001f600 caf\u00e9"
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"]) and "\ufffd" not in "".join(lp["tokens"])
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text), offsets
    # Streamed, a character split between two chunks is counted once: the offsets are the same.
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "logprobs": 1, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [o for c in chunks for ch in c["choices"] if ch.get("logprobs") for o in ch["logprobs"]["text_offset"]]
    assert streamed == offsets and "".join(ch["text"] for c in chunks for ch in c["choices"]) == text


def test_schema_limits(base_url, model_name):
    deep: dict = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}},
        },
    )
    assert r.status_code == 400 and "deeper" in r.json()["error"]["message"]
    huge = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(3000)},
    }
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": model_name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": huge}},
        },
    )
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]


def _corpus_sample(n: int) -> list[tuple[str, dict]]:
    files = sorted(CORPUS.glob("*.json"))
    step = max(1, len(files) // n)
    out = []
    for f in files[::step][:n]:
        out.append((f.name, json.loads(f.read_text())["schema"]))
    return out


@pytest.mark.skipif(not CORPUS.exists(), reason="shared corpus not present")
def test_corpus_schemas_validate_end_to_end(make_async_client, model_name, base_url):
    """A few hundred real schemas: every output whose grammar compiled and finished parses and validates."""
    sample = _corpus_sample(int(os.environ.get("GRAMSERVE_E2E_SCHEMAS", "200")))
    # 32 in flight: on a loaded 2-core box one request can take minutes, hence the long client timeout.
    client = make_async_client().with_options(timeout=1200)
    sem = asyncio.Semaphore(32)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER

    async def one(name: str, schema: dict):
        async with sem:
            try:
                r = await client.chat.completions.create(
                    model=model_name,
                    max_tokens=256,
                    temperature=0.7,
                    seed=0,
                    messages=[{"role": "user", "content": PROMPT.format(schema=json.dumps(schema)[:600])}],
                    response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                )
            except openai.BadRequestError as exc:
                return name, "rejected", str(exc)
            return name, r.choices[0].finish_reason, r.choices[0].message.content

    async def run():
        return await asyncio.gather(*(one(n, s) for n, s in sample))

    results = asyncio.run(run())
    schemas = dict(sample)
    finished = invalid = 0
    for name, finish, content in results:
        if finish != "stop":
            continue
        finished += 1
        try:
            # Decimals, not floats: 10000.89 is a multiple of 0.01, though 10000.89 / 0.01 is not an integer in
            # binary floating point (JSON numbers are decimal; backends enforce multipleOf on the decimal text).
            instance = json.loads(content, parse_float=Decimal)
            schema = json.loads(json.dumps(schemas[name]), parse_float=Decimal)
            # the draft the schema names ($schema), as the server's last check does; 2020-12 if none
            draft = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            validator = draft(schema, format_checker=checker)
            errors = list(validator.iter_errors(instance))
        except (json.JSONDecodeError, jsonschema.SchemaError, RecursionError) as exc:
            errors = [exc]
        if errors:
            invalid += 1
            print(f"INVALID {name}: {errors[0]}\n{content[:300]}")
    rejected = sum(1 for _, f, _ in results if f == "rejected")
    truncated = sum(1 for _, f, _ in results if f == "length")
    print(
        f"corpus e2e: {len(results)} schemas, {rejected} rejected (400), {finished} finished, "
        f"{truncated} hit max_tokens, {invalid} invalid"
    )
    assert finished >= 0.5 * len(results)
    assert invalid == 0
    from conftest import wait_pool_whole

    assert wait_pool_whole(base_url)["used_slots"] == 0


# Compiling this takes seconds on xgrammar (a counted repetition of a bounded group).
SLOW_SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^([a-z0-9]{5,50}-){20,40}$"}},
    "required": ["code"],
}


def test_compile_timeout_is_400_and_others_keep_running(tight_server):
    url = tight_server.base_url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            slow = asyncio.create_task(
                client.post(
                    url + "/v1/completions",
                    json={
                        **body,
                        "grammar_backend": "xgrammar",
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SLOW_SCHEMA}},
                    },
                )
            )
            fast = []
            while not slow.done():
                t0 = asyncio.get_running_loop().time()
                r = await client.post(url + "/v1/completions", json=body)
                fast.append((r.status_code, asyncio.get_running_loop().time() - t0))
            return await slow, fast

    slow, fast = asyncio.run(run())
    assert slow.status_code == 400 and "limit" in slow.json()["error"]["message"], slow.text
    assert fast and all(code == 200 for code, _ in fast)
    # Plain requests were served while the grammar compiled (the scheduler never waits on a compile).
    assert max(t for _, t in fast) < 5.0, fast


def test_mixed_constrained_and_plain_traffic(make_async_client, model_name, base_url):
    client = make_async_client()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "word": {"type": "string", "maxLength": 12}},
        "required": ["n", "word"],
        "additionalProperties": False,
    }

    async def constrained(i):
        r = await client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": f"Give a number and a word, #{i}"}],
            max_tokens=60,
            temperature=0.7,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        return r.choices[0]

    async def plain(i):
        r = await client.completions.create(
            model=model_name, prompt=f"Story {i}:", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0]

    async def run():
        return await asyncio.gather(*([constrained(i) for i in range(8)] + [plain(i) for i in range(8)]))

    results = asyncio.run(run())
    for choice in results[:8]:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert sum(c.finish_reason == "stop" for c in results[:8]) >= 6
    assert all(c.finish_reason == "length" and c.text for c in results[8:])


def test_last_check_reports_an_output_that_breaks_its_schema(client, model_name, base_url, tokenizer):
    """An output that ends on a token the client listed in stop_token_ids, inside the JSON, is not valid: it comes
    back with finish_reason invalid_output (never "stop"), and /get_server_info counts it. Outputs that end on EOS
    are checked and counted as valid."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    messages = [{"role": "user", "content": "A person as JSON."}]
    before = httpx.get(base_url + "/get_server_info", timeout=30).json()["output_checks"]
    ok = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=60, temperature=0, response_format=response_format
    )
    assert ok.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(ok.choices[0].message.content), schema)
    # Every token that can open the object stops the request at once: the text cannot be valid JSON.
    openers = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).lstrip().startswith("{")]
    cut = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=60,
        temperature=0,
        response_format=response_format,
        extra_body={"stop_token_ids": openers},
    )
    assert cut.choices[0].finish_reason == "invalid_output", cut
    after = httpx.get(base_url + "/get_server_info", timeout=30).json()["output_checks"]
    assert after["checked"] >= before["checked"] + 1
    # Sampled twice more (--grammar-check-retries 2), cut the same way each time.
    assert after["invalid"] == before["invalid"] + 3 and after["retried"] == before["retried"] + 2


def test_a_schema_no_grammar_enforces_is_served_relaxed_and_retried(client, model_name, base_url):
    """`not: {const: v}` is beyond every backend: auto serves the schema without it and checks each output. The
    greedy first attempt gives v (what the schema without `not` gives), fails the check, and is sampled again: the
    answer is a valid value or, if every retry gave v too, invalid_output, never v with "stop". A streamed request is
    not retried: its v ends as invalid_output."""
    base = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    messages = [{"role": "user", "content": "Pick a number from 0 to 9, as JSON."}]

    def ask(schema, **kw):
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        return client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=20, temperature=0, response_format=fmt, **kw
        )

    first = ask(base)
    v = json.loads(first.choices[0].message.content)["n"]
    schema = {**base, "not": {"properties": {"n": {"const": v}}}}
    before = httpx.get(base_url + "/get_server_info", timeout=30).json()["output_checks"]
    r = ask(schema)
    assert r.model_extra["grammar_backend"] == "llguidance:relaxed"
    after = httpx.get(base_url + "/get_server_info", timeout=30).json()["output_checks"]
    assert after["retried"] >= before["retried"] + 1
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert after["recovered"] == before["recovered"] + 1
    else:
        assert r.choices[0].finish_reason == "invalid_output"
    chunks = list(ask(schema, stream=True))
    assert chunks[-1].choices[0].finish_reason == "invalid_output"
    assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks))["n"] == v


def test_a_relaxed_output_whose_check_cannot_finish_is_not_returned_as_valid(client, model_name):
    """A relaxed grammar leaves keywords (dependentRequired here) to the last check; a check that runs out of time
    (the required key against a pattern that backtracks, ^(a|a)*$) enforced nothing, so the output ends as
    invalid_output, never "stop" (it was returned as valid, missing `cvv`)."""
    key = "a" * 28 + "b"
    schema = {
        "type": "object",
        "properties": {
            key: {"type": "integer", "minimum": 0, "maximum": 9},
            "card": {"type": "string", "maxLength": 4},
        },
        "patternProperties": {"^(a|a)*$": {"type": "integer"}},
        "required": [key, "card"],
        "dependentRequired": {"card": ["cvv"]},
        "additionalProperties": False,
        "maxProperties": 2,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "card", "schema": schema}}
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "A card."}], max_tokens=100, temperature=0,
            response_format=fmt, stream=True,
        )
    )  # fmt: skip
    assert chunks[-1].model_extra.get("grammar_backend", "").endswith(":relaxed") or any(
        c.model_extra.get("grammar_backend", "").endswith(":relaxed") for c in chunks
    )
    assert chunks[-1].choices[0].finish_reason == "invalid_output", chunks[-1]


def test_schema_in_prompt_writes_the_schema_into_the_system_prompt(tmp_path, tokenizer):
    """--grammar-schema-in-prompt: a chat response_format schema is also written into the system prompt (appended to
    the client's own system message, or in a system message first): the prompt the model sees is exactly that."""
    from conftest import start_server

    from gramserve.server.structured_outputs import SCHEMA_INSTRUCTION

    data = Path(__file__).resolve().parent / "data" / "tiny_llama.json"
    srv = start_server(str(tmp_path), "--model-path", str(data), "--load-format", "dummy", "--grammar-schema-in-prompt")
    try:
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
        user = {"role": "user", "content": "A city, as JSON."}
        instruction = SCHEMA_INSTRUCTION + json.dumps(schema, ensure_ascii=False)
        cases = [
            ([user], fmt, [{"role": "system", "content": instruction}, user]),
            (
                [{"role": "system", "content": "Be brief."}, user],
                fmt,
                [{"role": "system", "content": "Be brief.\n\n" + instruction}, user],
            ),
            ([user], None, [user]),  # no schema: the prompt as it was
        ]
        for messages, response_format, seen in cases:
            body = {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0}
            if response_format:
                body["response_format"] = response_format
            model = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
            r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "model": model}, timeout=120)
            assert r.status_code == 200, r.text
            expected = tokenizer.apply_chat_template(seen, add_generation_prompt=True, tokenize=False)
            assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(expected, add_special_tokens=False))
    finally:
        srv.stop()


def test_a_grammar_its_backend_gives_up_on_is_never_a_success(client, model_name):
    """llguidance's lexer gives up on this corpus schema ("too many expressions constructed") while filling masks:
    the answer is a 400 naming that (when it gives up before the first token) or an `abort`, never `stop` with a
    truncated string (a GPU run returned such outputs before the step reply named failed matchers)."""
    text = {"type": "string", "minLength": 1, "maxLength": 5000, "pattern": r"^$|(^(?:\S+\s+){0,99}\S+$)"}
    schema = {"type": "object", "properties": {"q": text}, "required": ["q"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "q", "schema": schema}}
    messages = [{"role": "user", "content": "Ask me a question, as JSON."}]
    try:
        r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=30, response_format=fmt)
    except openai.BadRequestError as exc:
        assert "too complex" in str(exc) and "too many expressions" in str(exc), exc
    else:  # gave up after some tokens: an abort (the last check would have made a "stop" into invalid_output)
        assert r.choices[0].finish_reason == "abort", r


def test_the_loop_guard_breaks_a_greedy_loop_inside_a_string(client, model_name, base_url):
    """Greedy, the default model writes "Github_easy_easy_easy_..." into this description until max_tokens (a corpus
    schema cut this way in docs/benchmarks.md, issue 19 run 4). The loop guard (on by default) bans the token that
    continues the loop: the answer ends on its own, valid, and /get_server_info counts the bans."""
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string"}, "description": {"type": "string"}, "order": {"type": "integer"}},
        "required": ["title", "description", "order"],
    }
    before = httpx.get(base_url + "/get_server_info", timeout=30).json()["grammar_timing"]["loop_bans"]
    content = _greedy_valid(client, model_name, "Give a JSON instance. sample Github_easy/o11171.json", schema, 200)
    assert "easy_" * 9 not in content
    after = httpx.get(base_url + "/get_server_info", timeout=30).json()["grammar_timing"]["loop_bans"]
    assert after > before


def test_unique_arrays_of_closed_sets_end_without_copies(client, model_name):
    """Greedy, the default model wrote "Sun" twice into a uniqueItems array of the seven days (every retry the same:
    invalid_output) and ran a uniqueItems array of booleans to max_tokens (`[false, true, true, ...]`). The loop
    guard keeps such items to the values not used yet, and ends the array when none is left."""
    days = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
    cases = [
        ({"days": {"type": "array", "items": {"enum": days}, "uniqueItems": True, "minItems": 3}}, "Which days?"),
        ({"flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 2}}, "Two flags."),
    ]
    for properties, question in cases:
        schema = {"type": "object", "properties": properties, "required": list(properties)}
        _greedy_valid(client, model_name, question + " Answer in JSON.", schema, 100)


def _greedy_valid(client, model_name: str, question: str, schema: dict, max_tokens: int) -> str:
    """A greedy answer under the schema, which must end on its own and validate; its text."""
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    content = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", content
    jsonschema.validate(json.loads(content), schema)
    return content


def test_thousands_of_choices_and_a_grammar_its_backend_gives_up_on_mid_output(client, model_name, base_url):
    """A choice of 2,500 labels (and the same as an EBNF alternation) stopped llguidance's matcher at its second
    token (an Earley row of 2,501 items; its limit was 2,000): a 200 with "w" and finish_reason "abort". Choices are
    now one regex lexeme, and rows may hold 20,000 items. A grammar past even that is an error, not a 200: the whole
    response a 400 naming the limit, a started stream its text then an error event (the SDK raises it)."""
    labels = [f"w{i}" for i in range(2500)]
    for extra in ({"guided_choice": labels}, {"ebnf": "root ::= " + " | ".join(f'"{w}"' for w in labels)}):
        out = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Pick one."}], max_tokens=10, extra_body=extra
        )
        assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content in labels, out
    beyond = {"ebnf": "root ::= " + "|".join(f'"w{i}"' for i in range(21000)), "grammar_backend": "llguidance"}
    body = {"model": model_name, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 10, **beyond}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and "too complex for its backend" in r.json()["error"]["message"], r.text
    with pytest.raises(openai.APIError, match="too complex for its backend"):
        stream = client.chat.completions.create(
            model=model_name, messages=body["messages"], max_tokens=10, stream=True, extra_body=beyond
        )
        for _ in stream:
            pass


def test_misplaced_or_misspelt_constraints_are_refused_not_dropped(base_url, model_name):
    """Each of these left the output unconstrained with a 200: a misspelt structured_outputs key, a constraint at
    /generate's top level, an unknown backend without a constraint. vLLM's spellings are read: the "guidance"
    backend, "name:options", boolean schemas; a regex of one space is a regex. Errors name the field used."""

    def completions(**body):
        return httpx.post(base_url + "/v1/completions", json={"model": model_name, "prompt": "x", **body}, timeout=60)

    r = completions(max_tokens=5, structured_outputs={"json_schema": {"type": "integer"}})
    assert r.status_code == 400 and "unknown keys ['json_schema']" in r.json()["error"]["message"], r.text
    r = httpx.post(base_url + "/generate", json={"text": "x", "regex": "a+", "sampling_params": {}}, timeout=60)
    assert r.status_code == 400 and "regex must be inside sampling_params" in r.json()["error"]["message"], r.text
    r = completions(max_tokens=5, grammar_backend="bogus")
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar_backend", r.text
    r = completions(max_tokens=5, structured_outputs={"regex": "a", "backend": ["x"]})  # was a 500
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.backend", r.text
    r = completions(max_tokens=5, guided_json=1)  # not read as true
    assert r.status_code == 400, r.text
    vllm = {"regex": "[ab]{2}", "disable_additional_properties": True, "_backend": "xgrammar"}  # asdict() of vLLM's
    r = completions(max_tokens=4, structured_outputs=vllm, temperature=0)
    assert r.status_code == 200 and re.fullmatch("[ab]{2}", r.json()["choices"][0]["text"]), r.text
    for backend in ("guidance", "xgrammar:disable-any-whitespace"):
        r = completions(max_tokens=6, guided_regex="[ab]{1,4}", guided_decoding_backend=backend, temperature=0)
        assert r.status_code == 200 and re.fullmatch("[ab]{1,4}", r.json()["choices"][0]["text"]), r.text
    r = completions(max_tokens=12, guided_json=True, temperature=0)
    assert r.status_code == 200 and r.json()["grammar_backend"], r.text
    r = completions(max_tokens=3, guided_regex=" ", temperature=0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " ", r.text
    r = completions(max_tokens=3, guided_regex="(?=a)abc")
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    for backend in ("outlines", "xgrammar", "llguidance"):  # outlines refused the anchors the others read
        r = completions(max_tokens=4, guided_regex="^[ab]{2}$", guided_decoding_backend=backend, temperature=0)
        assert r.status_code == 200 and re.fullmatch("[ab]{2}", r.json()["choices"][0]["text"]), (backend, r.text)


def test_server_info_splits_the_time_to_first_token(client, model_name, base_url):
    """/get_server_info reports, per request, how long the scheduler waited for a new grammar's compile and how long
    free and constrained requests took there from arrival to their first token (issue 18's TTFT breakdown)."""

    def info() -> dict:
        return httpx.get(base_url + "/get_server_info", timeout=30).json()

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "$comment": uuid4().hex}
    before = info()
    client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "x as JSON"}],
        max_tokens=8,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    after = info()
    for kind in ("free", "constrained"):
        grew = after["first_token_ms"][kind]["count"] - before["first_token_ms"][kind]["count"]
        assert grew >= 1, kind
        assert after["first_token_ms"][kind]["sum_ms"] > before["first_token_ms"][kind]["sum_ms"]
    assert after["grammar_wait_ms"]["count"] == before["grammar_wait_ms"]["count"] + 1  # a new grammar: one wait


def test_a_range_whose_bounds_are_not_multiples_is_served(client, model_name):
    """`multipleOf` 0.01 between 0.5 and 0.5051 (a new user's finding): 0.5 is the one valid value. llguidance's
    grammar allowed nothing (a 400 "no value satisfies it"), then auto switched the schema to xgrammar, which ignores
    multipleOf on numbers and wrote 0.503418. Every request now gets 0.5, from a backend that enforces it."""
    schema = {"type": "number", "multipleOf": 0.01, "minimum": 0.5, "maximum": 0.5051}
    for _ in range(3):  # past auto's background comparison of the backends
        r = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "A number."}],
            max_tokens=12,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
        assert r.choices[0].finish_reason == "stop", r
        assert json.loads(r.choices[0].message.content) == 0.5
        assert r.model_extra["grammar_backend"] == "llguidance"
        time.sleep(0.5)


def test_a_new_grammar_compiles_from_before_its_prompt_is_tokenized(client, model_name, base_url):
    """The main process asks for a new grammar's compile before it renders and tokenizes the request's prompt
    (GrammarPrefetchReq): once per grammar; the request joins that compile or finds it cached, and a grammar that
    cannot compile still fails its request with a 400."""

    def info() -> dict:
        return httpx.get(base_url + "/get_server_info", timeout=30).json()

    def ask(schema: dict):
        return client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "A person as JSON."}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "$comment": uuid4().hex,  # new to the server
    }
    before = info()
    first = ask(schema)
    after = info()
    assert after["grammar_prefetched"] == before["grammar_prefetched"] + 1
    compiles = [(after if i else before)["grammar_compiles"] for i in range(2)]
    served = {k: compiles[1].get(k, 0) - compiles[0].get(k, 0) for k in ("compiled", "cache", "shared", "failed")}
    assert served["compiled"] + served["cache"] == 1 and served["shared"] == served["failed"] == 0, served
    if first.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(first.choices[0].message.content), schema)
    again = ask(schema)  # seen lately: no second prefetch, the same answer
    assert info()["grammar_prefetched"] == after["grammar_prefetched"]
    assert again.choices[0].message.content == first.choices[0].message.content

    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}, "$comment": uuid4().hex}
    with pytest.raises(openai.BadRequestError) as err:
        ask(bad)
    assert "grammar" in str(err.value) or "pattern" in str(err.value)
    assert info()["grammar_prefetched"] == after["grammar_prefetched"] + 1


def test_a_prompt_prefills_while_its_new_grammar_compiles(client, model_name, base_url):
    """A request whose grammar is new prefills its whole prompt while the grammar compiles, and its last logits row
    waits on the device for the first mask (Scheduler.parked). Its greedy output equals the same request's once the
    grammar is cached (no parking), for a prompt longer than a prefill chunk (the compile ends during its prefill:
    nothing parks), for a short one, and for one whose prefix is already cached but for its last token."""

    def stats() -> dict:
        return httpx.get(base_url + "/get_server_info", timeout=30).json()["stats"]

    def ask(prompt: str, schema: dict) -> str:
        r = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
        assert r.choices[0].finish_reason in ("stop", "length"), r
        return r.choices[0].message.content

    def schema() -> dict:
        return {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "$comment": uuid4().hex,  # new to the server
        }

    long_prompt = "Describe one person as JSON. " + " ".join(f"fact {i}: nothing." for i in range(160))
    for prompt, parks in ((long_prompt, 0), ("A person as JSON, please.", 1)):
        parked_before = stats()["parked_samples"]
        s = schema()
        first = ask(prompt, s)  # the compile and the prefill overlap
        assert stats()["parked_samples"] == parked_before + parks
        assert ask(prompt, s) == first  # cached grammar: admitted at once, sampled at its prefill's end
        assert stats()["parked_samples"] == parked_before + parks
        again = ask(prompt, schema())  # the prompt's prefix is cached: one token to prefill, then parked
        assert stats()["parked_samples"] == parked_before + parks + 1
        assert again == first
