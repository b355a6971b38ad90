"""Function calling through HTTP with real clients: the openai SDK, instructor and LangChain.

The default model's ChatML template has no tool support, so the server writes the tool list and the
hermes call format into the system prompt; constrained calls (required, named, strict) must always parse
and validate against the tool's parameters, in non-streaming and streaming responses alike.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius? And what time is it in Tokyo?"}]


def check_call(name: str, arguments: str) -> dict:
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_named_function_call(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1
    assert calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    check_call(calls[0].function.name, calls[0].function.arguments)


def test_required_calls_validate(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,
        temperature=0.7,
        seed=3,
        n=3,
    )
    # The small model tends to repeat calls until max_tokens; every complete call returned must be valid.
    for choice in r.choices:
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
        calls = choice.message.tool_calls or []
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            check_call(call.function.name, call.function.arguments)
    assert any(c.message.tool_calls for c in r.choices)


def test_parallel_tool_calls_false_gives_one_call(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)


def test_stop_strings_end_the_text_answer_never_a_call(client, model_name):
    """OpenAI's `stop` ends the text answer; a call's markers and arguments are not cut by it (agent frameworks pass
    stop strings such as "\\n"). Before, a forced call came back as content "<tool_call>" with finish_reason stop."""
    one = dict(model=model_name, messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=80, temperature=0)
    # "<" (44) made likelier: the model opens a call in auto mode too.
    for extra in ({"tool_choice": "required"}, {"tool_choice": "auto", "logit_bias": {"44": 5}}):
        for stop in (["\n"], "}"):
            r = client.chat.completions.create(**one, **extra, stop=stop)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, (extra, stop, choice)
            check_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)
    chunks = list(client.chat.completions.create(**one, tool_choice="required", stop=["\n"], stream=True))
    calls = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert not any(c.delta.content for ch in chunks for c in ch.choices)
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_call(calls[0].function.name, "".join(tc.function.arguments or "" for tc in calls))
    # A text answer is still cut at the stop string.
    r = client.chat.completions.create(**one, tool_choice="auto", stop=[" "])
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content and " " not in r.choices[0].message.content


def test_auto_with_a_response_format_calls_tools_or_answers_in_the_format(client, model_name):
    """tool_choice auto plus a JSON response format (agent frameworks send both): the model may call the tools, and
    an answer without calls follows the format. Before, the format held the whole output and no call could start."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 30}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    one = dict(model=model_name, messages=ASK, tools=TOOLS, max_tokens=80, response_format=rf)
    r = client.chat.completions.create(**one, temperature=1.0, n=6, seed=1)
    for choice in r.choices:
        if choice.message.tool_calls:
            assert choice.message.content is None and choice.finish_reason in ("tool_calls", "length")
            for call in choice.message.tool_calls:
                check_call(call.function.name, call.function.arguments)
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert any(c.message.tool_calls for c in r.choices)
    # No call can start ("<" banned): the answer is in the format.
    r = client.chat.completions.create(**one, temperature=0, logit_bias={"44": -100})
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # An answer cut at max_tokens is "length", as without tools (not a failed check of the half-written answer).
    r = client.chat.completions.create(**{**one, "max_tokens": 3}, temperature=0, logit_bias={"44": -100})
    assert r.choices[0].finish_reason == "length", r.choices[0]
    # A forced call writes no text answer: the format has nothing to shape, the call is made (the OpenAI Agents SDK
    # sends tool_choice required with its output_type's schema; it was a 400).
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(**one, temperature=0, tool_choice=choice, parallel_tool_calls=False)
        call = r.choices[0].message.tool_calls[0]
        check_call(call.function.name, call.function.arguments)


def test_calls_before_a_cut_at_max_tokens_are_checked_too(client, model_name):
    """Calls completed before max_tokens cut the next one are returned: the last check validates them as well (a
    relaxed schema's dropped `not` went unchecked: {"city": "Paris"} came back beside finish_reason length)."""
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "not": {"properties": {"city": {"const": "Paris"}}},
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "book", "description": "Book a trip", "parameters": params}}]
    ask = [{"role": "user", "content": "Book my trips to Paris and Rome."}]
    kw = {"model": model_name, "messages": ask, "tools": tools, "tool_choice": "required", "max_tokens": 30}
    # Read whole, an output that fails the check is sampled again at a raised temperature: whatever comes back is
    # valid, or invalid_output.
    choice = client.chat.completions.create(**kw, temperature=0, seed=7).choices[0]
    assert choice.finish_reason in ("invalid_output", "length", "tool_calls"), choice
    if choice.finish_reason != "invalid_output":  # which names the calls that broke their schema
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), params)
    # Streamed, nothing is sampled again: greedy, the first call is {"city": "Paris"}, then the cut.
    chunks = list(client.chat.completions.create(**kw, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "invalid_output", chunks[-1]


def test_auto_calls_that_start_are_valid(client, model_name):
    # A history of earlier calls makes the small model open a call; whatever it opens must be valid.
    history = [
        {"role": "user", "content": "Weather in Rome in celsius?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        {"role": "assistant", "content": "It is 21 C and sunny in Rome."},
        {"role": "user", "content": "Weather in Oslo in fahrenheit?"},
    ]
    r = client.chat.completions.create(
        model=model_name, messages=history, tools=TOOLS, max_tokens=120, temperature=0.8, seed=7, n=4
    )
    for choice in r.choices:
        for call in choice.message.tool_calls or []:
            check_call(call.function.name, call.function.arguments)
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.message.content is not None


def test_tool_choice_none_answers_in_text(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


def test_stream_deltas_accumulate(client, model_name):
    # One call (parallel_tool_calls false): the small model otherwise repeats calls until max_tokens, and the
    # SDK refuses to build a final completion that finished on length.
    with client.chat.completions.stream(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=160,
    ) as stream:
        raw = []
        for event in stream:
            if event.type == "chunk":
                raw.append(event.chunk)
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    # OpenAI's delta shape: a call's first delta has id, type, name and arguments ""; later ones only
    # index and argument fragments.
    seen: dict[int, dict] = {}
    for chunk in raw:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.index not in seen:
                    assert d.id and d.type == "function" and d.function.name
                    assert d.function.arguments is not None
                    seen[d.index] = {"name": d.function.name, "arguments": d.function.arguments}
                else:
                    assert d.id is None and d.function.name is None
                    seen[d.index]["arguments"] += d.function.arguments or ""
    assert [seen[i]["name"] for i in sorted(seen)] == [c.function.name for c in choice.message.tool_calls]
    for i, call in zip(sorted(seen), choice.message.tool_calls):
        assert json.loads(seen[i]["arguments"]) == json.loads(call.function.arguments)


def test_stream_calls_after_the_first_come_as_one_delta_each(client, model_name):
    """Calls after the first are held until complete (a repeat is never streamed), then sent as one entry with their
    whole arguments (before: one entry per fragment, ~14 entries of one index in one chunk)."""
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=100,
            temperature=0,
            stream=True,
        )
    )
    later = []
    for chunk in chunks:
        for c in chunk.choices:
            indexes = [d.index for d in c.delta.tool_calls or []]
            assert len(indexes) == len(set(indexes)), indexes
            later += [d for d in c.delta.tool_calls or [] if d.index > 0]
    assert later, "the default model writes a second call here"
    for d in later:
        assert d.id and d.function.name
        check_call(d.function.name, d.function.arguments)


def test_stream_named_function_finishes_with_stop(base_url, model_name):
    body = {
        "model": model_name,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 80,
        "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    reasons, args, names = [], "", []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                reasons.append(c.get("finish_reason"))
                for d in c["delta"].get("tool_calls", []):
                    if "name" in d.get("function", {}):
                        names.append(d["function"]["name"])
                    args += d.get("function", {}).get("arguments", "")
    assert names == ["get_time"]
    check_call("get_time", args)
    assert [x for x in reasons if x] == ["stop"]


def test_truncated_call_reports_length(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        max_tokens=6,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.tool_calls
    assert r.choices[0].message.content is None  # the cut call is dropped, never returned as text


PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


def test_repeated_call_ends_the_turn(client, model_name):
    """The default model repeats get_weather(Paris) until max_tokens when parallel calls are allowed: the repeat
    ends the turn with the calls made so far (no duplicate, no cut call in the content), as with
    parallel_tool_calls false."""
    for stream in (False, True):
        kwargs = dict(model=model_name, messages=PARIS, tools=[WEATHER], tool_choice="required", max_tokens=200)
        if not stream:
            choice = client.chat.completions.create(temperature=0, **kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            reason, content = choice.finish_reason, choice.message.content
        else:
            parts: dict[int, list[str]] = {}
            reason, content = None, ""
            for chunk in client.chat.completions.create(temperature=0, stream=True, **kwargs):
                d = chunk.choices[0].delta
                content += d.content or ""
                for t in d.tool_calls or []:
                    e = parts.setdefault(t.index, ["", ""])
                    e[0] += t.function.name or ""
                    e[1] += t.function.arguments or ""
                reason = chunk.choices[0].finish_reason or reason
            calls = [tuple(parts[i]) for i in sorted(parts)]
        assert reason == "tool_calls", (stream, reason, calls)
        assert not content
        signatures = [(n, json.dumps(json.loads(a), sort_keys=True)) for n, a in calls]
        assert calls and len(set(signatures)) == len(signatures), calls
        for name, args in calls:
            check_call(name, args)


# Parameters no grammar enforces exactly: if/then (kind "a" needs n), uniqueItems.
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a table.",
        "parameters": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["a", "b"]},
                "n": {"type": "integer", "minimum": 1, "maximum": 9},
                "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "uniqueItems": True, "maxItems": 3},
            },
            "required": ["kind", "tags"],
            "additionalProperties": False,
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"required": ["n"]},
        },
    },
}


def test_tool_schema_no_grammar_enforces_is_served_relaxed_and_checked(base_url, model_name):
    """Tool parameters are audited like response_format schemas: xgrammar, which would drop if/then and
    uniqueItems silently, refuses them (400); auto serves the closest grammar and holds every call to the tool's
    whole schema: a call that breaks it is sampled again (non-streamed) or ends the choice as invalid_output, and
    a choice that reports tool_calls carries only valid calls."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Book a table for two."}],
        "tools": [BOOK],
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 1.0,
    }
    refused = httpx.post(base_url + "/v1/chat/completions", json={**body, "grammar_backend": "xgrammar"}, timeout=60)
    assert refused.status_code == 400 and "if" in refused.json()["error"]["message"], refused.text
    schema = BOOK["function"]["parameters"]
    before = httpx.get(base_url + "/get_server_info", timeout=30).json()["output_checks"]
    reasons = []
    for seed in range(4):
        for stream in (False, True):
            asked = {**body, "seed": seed, "stream": stream}
            r = httpx.post(base_url + "/v1/chat/completions", json=asked, timeout=300)
            assert r.status_code == 200, r.text
            if stream:
                events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                reason = next(e["choices"][0]["finish_reason"] for e in events[::-1] if e["choices"])
                parts: dict[int, str] = {}
                for e in events:
                    for t in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"] else []:
                        parts[t["index"]] = parts.get(t["index"], "") + (t["function"].get("arguments") or "")
                arguments = [parts[i] for i in sorted(parts)]
            else:
                assert r.json()["grammar_backend"] == "llguidance:relaxed"
                choice = r.json()["choices"][0]
                reason = choice["finish_reason"]
                arguments = [c["function"]["arguments"] for c in choice["message"].get("tool_calls") or []]
            reasons.append(reason)
            if reason == "tool_calls":
                for a in arguments:
                    jsonschema.validate(json.loads(a), schema)
            elif reason == "invalid_output":  # deserved: some call breaks the schema
                assert any(not jsonschema.Draft202012Validator(schema).is_valid(json.loads(a)) for a in arguments)
            else:
                assert reason == "length", reason
    after = httpx.get(base_url + "/get_server_info", timeout=30).json()["output_checks"]
    assert after["checked"] + after["invalid"] > before["checked"] + before["invalid"]  # the calls were checked
    assert "tool_calls" in reasons or "invalid_output" in reasons, reasons


def test_history_with_tool_results(client, model_name):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"timezone": "JST"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18 C, cloudy"},
        {"role": "tool", "tool_call_id": "call_b", "content": "21:05"},
    ]
    r = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 100  # the tool list, the calls and the results are all in the prompt


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]}, "tools"),
        # Arguments are a JSON object: a non-object schema gave "required" a turn with no call, its markup as text.
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "[a-z]+"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, None),
        ({"tools": TOOLS, "grammar_backend": "nope"}, "grammar_backend"),
        # OpenAI's deprecated form: a forced call must not be dropped silently (it answered in plain text)
        ({"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        # booleans are booleans (pydantic's lax mode read "yes" as true; OpenAI answers 400)
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, None),
        ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}]}, None),
        # a schema no backend can serve is the tools' fault, not response_format's
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"a": {"pattern": "(["}}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tool_requests_get_400(base_url, model_name, body, param):
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=60,
        json={"model": model_name, "messages": ASK, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_history_arguments_that_are_not_json_are_read_as_empty(base_url, model_name):
    """A call cut at max_tokens, sent back by an agent framework (the OpenAI Agents SDK's streamed runs do), must not
    fail the next turn: its arguments are read as {} (they were a 400)."""
    messages = ASK + [
        {
            "role": "assistant",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}],
        }
    ]
    r = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=60,
        json={"model": model_name, "messages": messages, "tools": TOOLS, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text


# --- the openai SDK's helpers --------------------------------------------------------------------


class Weather(BaseModel):
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


class CityFacts(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    founded: int = Field(ge=0, le=2100)


def test_sdk_parse_with_pydantic_function_tool(client, model_name):
    import openai

    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    assert tool["function"]["strict"] is True
    r = client.chat.completions.parse(
        model=model_name,
        messages=ASK,
        tools=[tool],
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)


def test_sdk_parse_with_response_format(client, model_name):
    r = client.chat.completions.parse(
        model=model_name,
        max_tokens=80,
        response_format=CityFacts,
        messages=[{"role": "user", "content": "Give facts about Paris as JSON."}],
    )
    assert isinstance(r.choices[0].message.parsed, CityFacts)


# --- instructor and LangChain --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(base_url, model_name, mode):
    import instructor
    from openai import OpenAI

    raw = OpenAI(base_url=base_url + "/v1", api_key="none", timeout=120, max_retries=0)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    facts = client.chat.completions.create(
        model=model_name,
        response_model=CityFacts,
        max_retries=0,
        max_tokens=80,
        messages=[{"role": "user", "content": "Facts about Rome, please."}],
    )
    assert isinstance(facts, CityFacts)


def test_langchain_bind_tools_and_structured_output(base_url, model_name):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        model=model_name,
        base_url=base_url + "/v1",
        api_key="none",
        max_tokens=80,
        temperature=0,
        use_responses_api=False,
        max_retries=0,
        timeout=120,
    )
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Madrid in celsius?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["unit"] in ("celsius", "fahrenheit")

    for method in ("function_calling", "json_schema"):
        out = llm.with_structured_output(CityFacts, method=method).invoke("Facts about Berlin.")
        assert isinstance(out, CityFacts), method


# --- a chat template with native tool support ------------------------------------------------------

TEMPLATE = __import__("pathlib").Path(__file__).parent / "data" / "tools_chatml.jinja"


@pytest.fixture(scope="module")
def native_server(tmp_path_factory):
    from conftest import start_server

    srv = start_server(str(tmp_path_factory.mktemp("native-tools")), "--chat-template", str(TEMPLATE))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_native_template_gets_tools_and_dict_arguments(native_server):
    from transformers import AutoTokenizer

    from gramserve.model.loader import default_tokenizer_dir

    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
    ]
    r = httpx.post(
        native_server.base_url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "default",
            "messages": history,
            "tools": TOOLS,
            "max_tokens": 80,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    check_call(call["function"]["name"], call["function"]["arguments"])
    # The prompt is exactly the template rendered with tools= and dict arguments (no system-prompt injection).
    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    expected = [dict(m) for m in history]
    expected[1] = {
        **expected[1],
        "content": "",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
            }
        ],
    }
    text = tok.apply_chat_template(
        expected,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"],
                },
            }
            for t in TOOLS
        ],
        chat_template=TEMPLATE.read_text(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))


def test_a_function_without_parameters_takes_none(client, model_name):
    """OpenAI: omitting `parameters` defines a function with an empty parameter list. Its calls' arguments are {}
    (they held any keys the model made up: {"city": "Paris", ...})."""
    now = {"type": "function", "function": {"name": "now", "description": "The current time."}}
    for seed in range(3):
        out = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "What time is it in Paris?"}],
            tools=[now],
            tool_choice="required",
            max_tokens=40,
            temperature=1.0,
            seed=seed,
        )
        calls = out.choices[0].message.tool_calls
        assert calls and all(c.function.name == "now" and json.loads(c.function.arguments) == {} for c in calls), out


def test_parameters_without_a_type_still_take_an_object(client, model_name):
    """{"properties": ...} alone (as MCP servers write tool schemas) allowed any JSON value: a random-weight model
    wrote `false`, strings and arrays as arguments. The tool's schema is read as an object's."""
    from gramserve.config import ServerArgs
    from gramserve.server import protocol as P
    from gramserve.server.tool_requests import plan_tools

    params = {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    messages = [{"role": "user", "content": "Call f."}]
    req = P.ChatCompletionRequest(model=model_name, messages=messages, tools=tools, tool_choice="required")
    assert plan_tools(req, "hermes", ServerArgs()).tools[0].parameters == {"type": "object", **params}
    r = client.chat.completions.create(
        model=model_name, messages=messages, tools=tools, tool_choice="required", temperature=1.0, n=3, seed=3
    )
    for choice in r.choices:
        for call in choice.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), {"type": "object", **params})
