"""Reasoning models through HTTP: `--reasoning-parser deepseek-r1` splits `reasoning_content` from `content`,
and an output constraint (regex, JSON schema, tool calls) applies only after the reasoning's end marker.

The default model does not think on its own; a two-turn history makes it repeat "I am thinking.</think>123",
so the reasoning phase and its end marker come from the model itself.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from conftest import start_server

REPEAT = [
    {"role": "user", "content": "Repeat after me exactly: I am thinking.</think>123"},
    {"role": "assistant", "content": "I am thinking.</think>123"},
    {"role": "user", "content": "Again, exactly the same: I am thinking.</think>123"},
]


@pytest.fixture(scope="module")
def r1_url(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("r1")), "--reasoning-parser", "deepseek-r1")
    yield srv.base_url + "/v1/chat/completions"
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def r1_overlap_url(tmp_path_factory):
    srv = start_server(
        str(tmp_path_factory.mktemp("r1o")), "--reasoning-parser", "deepseek-r1", "--overlap-schedule", "on"
    )
    yield srv.base_url + "/v1/chat/completions"
    assert srv.stop() == 0, srv.log()[-3000:]


def chat(url: str, **body) -> dict:
    r = httpx.post(url, json={"model": "default", "max_tokens": 40, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_reasoning_is_split_from_content(r1_url):
    choice = chat(r1_url, messages=REPEAT)
    assert choice["message"]["reasoning_content"] == "I am thinking."
    assert choice["message"]["content"] == "123"


def test_grammar_starts_after_the_reasoning(r1_url):
    # Unconstrained the answer is "123"; the regex forces letters, but only after </think>.
    choice = chat(r1_url, messages=REPEAT, regex="[a-z]{3}")
    assert choice["message"]["reasoning_content"] == "I am thinking."
    assert re.fullmatch("[a-z]{3}", choice["message"]["content"])
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    choice = chat(
        r1_url, messages=REPEAT, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    )
    assert choice["message"]["reasoning_content"] == "I am thinking."
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_tool_call_after_reasoning(r1_url):
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"code": {"type": "integer"}}, "required": ["code"]},
        },
    }
    choice = chat(
        r1_url,
        messages=REPEAT,
        tools=[tool],
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    )
    assert choice["message"]["reasoning_content"] == "I am thinking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup"
    assert isinstance(json.loads(call["function"]["arguments"])["code"], int)


def test_truncated_reasoning_is_all_reasoning(r1_url):
    choice = chat(r1_url, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"]
    assert choice["message"]["content"] is None


def test_separate_reasoning_false_keeps_the_text(r1_url):
    choice = chat(r1_url, messages=REPEAT, separate_reasoning=False)
    assert "reasoning_content" not in choice["message"]
    assert choice["message"]["content"] == "I am thinking.</think>123"


def test_streamed_reasoning_matches(r1_url):
    whole = chat(r1_url, messages=REPEAT, regex="[a-z]{3}")
    reasoning = content = ""
    with httpx.stream(
        "POST",
        r1_url,
        timeout=120,
        json={
            "model": "default",
            "messages": REPEAT,
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
            "regex": "[a-z]{3}",
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    reasoning += c["delta"].get("reasoning_content", "")
                    content += c["delta"].get("content", "") or ""
    assert reasoning == whole["message"]["reasoning_content"]
    assert content == whole["message"]["content"]


def test_grammar_after_reasoning_under_the_overlap_schedule(r1_overlap_url):
    """The overlap loop asks for a step's masks before it records the tokens just read; a grammar that starts
    with one of those tokens (the end marker) gets its first mask in a second request to the grammar process."""
    test_grammar_starts_after_the_reasoning(r1_overlap_url)
    test_tool_call_after_reasoning(r1_overlap_url)
