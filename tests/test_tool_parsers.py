"""Tool-call parsers (gramserve.parsers.tool_calls): one-shot and streaming parses of recorded model
outputs, registry and template detection, system prompts, and structural tags compiled by our
grammar backends (only the default tokenizer is needed, no model).

Streaming equivalence, checked for every split into two chunks, random multi-chunk splits and one
character at a time: the concatenated streamed content equals ``parse().content`` (or "" for
None) exactly -- both are the text outside the calls with ``str.strip`` applied to the whole -- and
the streamed calls equal the one-shot calls: same order, names, and the concatenated argument
fragments are the same string as ``parse()``'s arguments.
"""

from __future__ import annotations

import json
import random

import pytest

from gramserve.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ParseResult,
    ToolCall,
    ToolFunction,
    bound_calls,
    detect_tool_call_parser,
    get_tool_call_parser,
)

TOOLS = [
    ToolFunction(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
        "Current weather",
    ),
    ToolFunction(
        "search",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {
                    "type": "object",
                    "properties": {"max": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                },
            },
            "required": ["query"],
        },
    ),
    ToolFunction("get_time", {"type": "object", "properties": {}}),
]

PARIS = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", "{}")
SEARCH_ARGS = '{"query": "a } b </tool_call> [TOOL_CALLS] \\" c", "filters": {"max": 3, "tags": ["x", "y"]}}'
SEARCH = ("search", SEARCH_ARGS)
ZURICH = ("get_weather", '{"city": "Zürich 🌧", "days": 2}')

PLAIN = [
    ("plain", "The weather in Paris is usually mild.", "The weather in Paris is usually mild.", []),
    ("plain_markup", 'Compare a <b with <tool and [TOOL and {x} or [1, 2](see) {"a": 1}', None, []),
    ("empty", "", None, []),
    ("whitespace", "  \n ", None, []),
]

# name -> [(case id, model output, expected content (None: same as the text, stripped), calls)]
CASES: dict[str, list] = {
    "hermes": [
        (
            "one",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            "",
            [PARIS],
        ),
        (
            "two",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "",
            [PARIS, TIME],
        ),
        (
            "text_before",
            f'Let me look that up.\n\n<tool_call>\n{{"name": "search", "arguments": {SEARCH_ARGS}}}\n</tool_call>',
            "Let me look that up.",
            [SEARCH],
        ),
        (
            "unicode_compact",
            '<tool_call>{"name":"get_weather","arguments":{"city": "Zürich 🌧", "days": 2}}</tool_call>',
            "",
            [ZURICH],
        ),
        ("text_after", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.', "Done.", [TIME]),
        ("no_closing_tag", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [TIME]),
        (
            "type_function",
            '<tool_call>\n{"type": "function", "name": "get_time", "parameters": {}}\n</tool_call>',
            "",
            [TIME],
        ),
    ],
    "llama3": [
        ("one", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [PARIS]),
        (
            "python_tag",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            "",
            [PARIS],
        ),
        (
            "two",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {}}',
            "",
            [PARIS, TIME],
        ),
        ("type_function", f'{{"type": "function", "name": "search", "parameters": {SEARCH_ARGS}}}', "", [SEARCH]),
        (
            "text_before",
            'Sure.\n<|python_tag|>{"name": "get_weather", "arguments": {"city": "Zürich 🌧", "days": 2}}',
            "Sure.",
            [ZURICH],
        ),
        ("json_content", '{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        (
            "one",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
            "",
            [PARIS],
        ),
        (
            "two",
            f'[TOOL_CALLS] [{{"name": "search", "arguments": {SEARCH_ARGS}}}, {{"name": "get_time", "arguments": {{}}}}]',
            "",
            [SEARCH, TIME],
        ),
        ("v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "", [PARIS]),
        (
            "v11_two",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
            "",
            [PARIS, TIME],
        ),
        ("v11_call_id", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}", "", [TIME]),
        (
            "text_before",
            'Checking.[TOOL_CALLS][{"name":"get_weather","arguments":{"city": "Zürich 🌧", "days": 2}}]',
            "Checking.",
            [ZURICH],
        ),
    ],
    "pythonic": [
        ("one", "[get_weather(city='Paris', unit='celsius')]", "", [PARIS]),
        ("two", '[get_weather(city="Paris", unit="celsius"), get_time()]', "", [PARIS, TIME]),
        (
            "nested",
            "[search(query='a } b </tool_call> [TOOL_CALLS] \" c', filters={'max': 3, 'tags': ('x', 'y')})]",
            "",
            [SEARCH],
        ),
        ("text_before", "I will check.\n[get_weather(city='Zürich 🌧', days=2)]", "I will check.", [ZURICH]),
        ("text_after", "[get_time()]\nok", "ok", [TIME]),
        ("list_content", "Numbers: [1, 2, 3] and [x] (y)", None, []),
    ],
    "qwen3_coder": [
        (
            "one",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
            "</function>\n</tool_call>",
            "",
            [PARIS],
        ),
        (
            "two",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            "",
            [PARIS, TIME],
        ),
        (
            "typed",
            'Let me search.\n<tool_call>\n<function=search>\n<parameter=query>\na } b </tool_call> [TOOL_CALLS] " c\n</parameter>\n'
            '<parameter=filters>\n{"max": 3, "tags": ["x", "y"]}\n</parameter>\n</function>\n</tool_call>',
            "Let me search.",
            [SEARCH],
        ),
        (
            "integer",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 🌧\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n</tool_call>",
            "",
            [ZURICH],
        ),
    ],
    "deepseek_v3": [
        (
            "one",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "",
            [PARIS],
        ),
        (
            "two",
            f"Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{SEARCH_ARGS}\n```<｜tool▁call▁end｜>\n"
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Let me check.",
            [SEARCH, TIME],
        ),
        (
            "unicode",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Zürich 🌧", "days": 2}\n```'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "",
            [ZURICH],
        ),
    ],
    "kimi_k2": [
        (
            "one",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris", "unit": "celsius"}<|tool_call_end|><|tool_calls_section_end|>',
            "",
            [PARIS],
        ),
        (
            "two",
            "I'll check. <|tool_calls_section_begin|>\n<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
            f"{SEARCH_ARGS}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{{}}<|tool_call_end|>\n"
            "<|tool_calls_section_end|>",
            "I'll check.",
            [SEARCH, TIME],
        ),
        (
            "unicode",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Zürich 🌧", "days": 2}<|tool_call_end|><|tool_calls_section_end|>',
            "",
            [ZURICH],
        ),
    ],
}
CASES["deepseek_v3"].append(
    (
        "v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "unit": "celsius"}<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [PARIS, ("function", "{}")],
    )
)
CASES["qwen25"] = CASES["hermes"]
CASES["deepseek_v31"] = CASES["deepseek_v3"]

# Malformed outputs: parse() keeps them as text and never raises (name -> [(id, text, calls)]).
MALFORMED: dict[str, list] = {
    "hermes": [
        ("truncated", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
        ("bad_name", '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>', []),
        ("bad_json", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', []),
        ("args_not_object", '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', []),
        ("open_only", "<tool_call>", []),
        (
            "second_broken",
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "x", "arguments": {]}\n</tool_call>',
            [TIME],
        ),
    ],
    "llama3": [
        ("truncated", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par', []),
        ("bad_name", '{"name": 12, "parameters": {}}', []),
        ("bad_json", '{"name": "get_weather", "parameters": {"city": Paris}}', []),
    ],
    "mistral": [
        ("truncated", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', []),
        ("bad_name", '[TOOL_CALLS][{"name": get_weather, "arguments": {}}]', []),
        ("v11_bad_name", "[TOOL_CALLS]get weather[ARGS]{}", []),
        ("unclosed_array", '[TOOL_CALLS][{"name": "get_time", "arguments": {}} junk', []),
    ],
    "pythonic": [
        ("truncated", "[get_weather(city='Par", []),
        ("positional", "[get_weather('Paris')]", []),
        ("not_literal", "[get_weather(city=lookup())]", []),
        ("bad_syntax", "[get_weather(city=='Paris')]", []),
        ("unbalanced", "[get_weather(city='Paris']", []),
    ],
    "qwen3_coder": [
        ("truncated", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", []),
        ("bad_name", "<tool_call>\n<function get_weather>\n</function>\n</tool_call>", []),
        ("junk", "<tool_call>\n<function=get_time>\nhello\n</function>\n</tool_call>", []),
    ],
    "deepseek_v3": [
        (
            "truncated",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Par',
            [],
        ),
        (
            "bad_json",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{city}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            [],
        ),
    ],
    "kimi_k2": [
        (
            "truncated",
            '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Par',
            [],
        ),
        (
            "bad_json",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{]<|tool_call_end|><|tool_calls_section_end|>",
            [],
        ),
    ],
}
MALFORMED["qwen25"] = MALFORMED["hermes"]
MALFORMED["deepseek_v31"] = MALFORMED["deepseek_v3"]

ALL_CASES = [
    pytest.param(name, text, content, calls, id=f"{name}-{cid}")
    for name in TOOL_CALL_PARSERS
    for cid, text, content, calls in PLAIN + CASES[name]
]
ALL_MALFORMED = [
    pytest.param(name, text, calls, id=f"{name}-{cid}")
    for name in TOOL_CALL_PARSERS
    for cid, text, calls in MALFORMED[name]
]


def parser(name: str, tools=TOOLS):
    return get_tool_call_parser(name)(tools)


def stream(name: str, chunks: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    """Feed the chunks, then finish; checks the delta protocol; returns (content, [(name, args)])."""
    p = parser(name, tools)
    content = ""
    names: list[str] = []
    args: list[str] = []
    for d in [p.feed(c) for c in chunks] + [p.finish()]:
        content += d.content
        for c in d.calls:
            if c.name is not None:
                assert c.index == len(names), "calls are numbered 0, 1, 2 ... in order"
                assert c.arguments == "", "the first delta of a call carries the name only"
                names.append(c.name)
                args.append("")
            else:
                assert 0 <= c.index < len(names), "argument fragments follow the call's name"
                assert c.arguments
                args[c.index] += c.arguments
    assert p.finish().content == "" and not p.finish().calls, "finish() is idempotent"
    return content, list(zip(names, args))


def splits(text: str, seed: int = 0):
    """Every split into two chunks, one character at a time, and random multi-chunk splits."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def as_pairs(result: ParseResult) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.calls]


@pytest.mark.parametrize("name,text,content,calls", ALL_CASES)
def test_parse(name, text, content, calls):
    r = parser(name).parse(text)
    expected = text.strip() if content is None else content
    assert r.content == (expected or None)
    assert as_pairs(r) == calls
    for c in r.calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("name,text,content,calls", ALL_CASES)
def test_streaming_matches_parse_for_every_split(name, text, content, calls):
    r = parser(name).parse(text)
    for chunks in splits(text):
        got_content, got_calls = stream(name, chunks)
        assert got_content == (r.content or ""), chunks
        assert got_calls == as_pairs(r), chunks


@pytest.mark.parametrize("name,text,calls", ALL_MALFORMED)
def test_malformed_output_is_text(name, text, calls):
    r = parser(name).parse(text)
    assert as_pairs(r) == calls
    if not calls:
        assert r.content == text.strip()
    for chunks in splits(text):  # never raises; complete calls are the same
        got_content, got_calls = stream(name, chunks)
        assert [c for c in got_calls if c in calls] == calls


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_mutated_outputs_never_raise(name):
    """Random truncations, deletions, duplications and junk in recorded outputs: parse() and
    streaming never raise, and every call parse() returns has JSON object arguments; when no
    call was started, streaming equals parse()."""
    rng = random.Random(name)
    texts = [t for _, t, _, _ in CASES[name]] + [t for _, t, _ in MALFORMED[name]]
    for _ in range(150):
        text = rng.choice(texts)
        i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        text = rng.choice(
            [
                text[:i],
                text[:i] + text[j:],
                text[:j] + text[i:],
                text[:i] + rng.choice(['"', "}", "<", "[", "\\", "\n", "(", "'"]) + text[i:],
            ]
        )
        r = parser(name).parse(text)
        for c in r.calls:
            assert isinstance(json.loads(c.arguments), dict)
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        content, calls = stream(name, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        if not calls:
            assert content == (r.content or "") and not r.calls, text


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "deepseek_v3", "kimi_k2"])
def test_truncated_call_streams_partial_arguments(name):
    """Streaming cannot take back what it sent: a call cut off mid-arguments keeps its name and a
    valid JSON prefix of its arguments (the server reports finish_reason "length"), while
    parse() returns the text as content."""
    text = dict((cid, t) for cid, t, _ in MALFORMED[name])["truncated"]
    content, calls = stream(name, [text])
    assert content == ""
    assert calls == [("get_weather", '{"city": "Par')]


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "deepseek_v3", "kimi_k2"])
def test_arguments_stream_progressively(name):
    p = parser(name)
    text = p.render_calls([("search", json.loads(SEARCH_ARGS))])
    cut = text.index('"filters"')
    first = p.feed(text[:cut])
    assert [c.name for c in first.calls] == ["search", None]
    sent = first.calls[1].arguments
    assert sent and SEARCH_ARGS.startswith(sent)
    rest = p.feed(text[cut:])
    rest_args = "".join(c.arguments for c in rest.calls + p.finish().calls)
    assert sent + rest_args == SEARCH_ARGS


def test_qwen3_coder_streams_parameters_and_string_values():
    p = parser("qwen3_coder")
    d = p.feed("<tool_call>\n<function=search>\n<parameter=query>\nfirst line\nsecond</par")
    assert [(c.name, c.arguments) for c in d.calls] == [("search", ""), (None, '{"query": "first line\\nsecond')]
    d = p.feed('ameter>\n<parameter=filters>\n{"max": 3')
    assert [c.arguments for c in d.calls] == ['"']  # the typed value waits for its closing tag
    d = p.feed("}\n</parameter>\n</function>\n</tool_call>")
    assert [c.arguments for c in d.calls] == [', "filters": {"max": 3}}']


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_partial_marker_held_back_then_released(name):
    p = parser(name)
    marker = p.render_calls([("get_time", {})])[:6]  # "<tool_", "[TOOL_", '{"name', "[get_t", ...
    assert p.feed("Hello " + marker).content == "Hello"
    assert p.feed("~ is text").content == " " + marker + "~ is text"
    assert p.feed(" " + marker).content == ""
    d = p.finish()
    assert d.content == " " + marker and not d.calls


def test_invalid_json_prefix_stops_streaming_early():
    p = parser("hermes")
    d = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call> after')
    assert d.calls == [] and d.content.startswith("<tool_call>")


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_render_parse_roundtrip(name):
    p = parser(name)
    calls = [
        ("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}),
        ("search", {"query": "x", "filters": {"max": 1, "tags": ["a"]}}),
        ("get_time", {}),
    ]
    r = p.parse(p.render_calls(calls))
    assert r.content is None
    assert [(c.name, json.loads(c.arguments)) for c in r.calls] == calls


def test_unknown_tool_names_are_returned():
    r = parser("hermes").parse('<tool_call>\n{"name": "no_such_tool", "arguments": {"a": 1}}\n</tool_call>')
    assert r.calls == [ToolCall("no_such_tool", '{"a": 1}')]


def test_qwen3_coder_coerces_by_schema():
    tools = [
        ToolFunction(
            "f",
            {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "i": {"type": "integer"},
                    "n": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "opt": {"type": ["integer", "null"]},
                    "u": {},
                },
            },
        )
    ]
    text = (
        "<tool_call>\n<function=f>\n"
        + "".join(
            f"<parameter={k}>\n{v}\n</parameter>\n"
            for k, v in [
                ("s", "007"),
                ("i", "42"),
                ("n", "2.5"),
                ("b", "True"),
                ("o", "{'k': [1]}"),
                ("a", "[1, 2]"),
                ("opt", "null"),
                ("u", "3"),
                ("extra", "x\ny"),
            ]
        )
        + "</function>\n</tool_call>"
    )
    r = parser("qwen3_coder", tools).parse(text)
    assert json.loads(r.calls[0].arguments) == {
        "s": "007",
        "i": 42,
        "n": 2.5,
        "b": True,
        "o": {"k": [1]},
        "a": [1, 2],
        "opt": None,
        "u": 3,
        "extra": "x\ny",
    }


def test_registry_and_detection():
    assert set(TOOL_CALL_PARSERS) >= {
        "hermes",
        "qwen25",
        "llama3",
        "mistral",
        "pythonic",
        "qwen3_coder",
        "deepseek_v3",
        "kimi_k2",
    }
    assert get_tool_call_parser("deepseek-v3") is TOOL_CALL_PARSERS["deepseek_v3"]
    with pytest.raises(ValueError, match="hermes"):
        get_tool_call_parser("nope")
    assert detect_tool_call_parser("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}", None) == "hermes"
    assert detect_tool_call_parser("<tool_call>\\n", "qwen2") == "qwen25"
    assert detect_tool_call_parser("<tool_call>\n<function=' + name + '>", "qwen3_moe") == "qwen3_coder"
    assert detect_tool_call_parser("{{- '<|python_tag|>' }}", "llama") == "llama3"
    assert detect_tool_call_parser("[TOOL_CALLS] [", None) == "mistral"
    assert detect_tool_call_parser("{{'<｜tool▁calls▁begin｜>'}}", None) == "deepseek_v3"
    assert detect_tool_call_parser("<|tool_calls_section_begin|>", None) == "kimi_k2"
    assert detect_tool_call_parser("[func_name1(params_name1=params_value1)]", None) == "pythonic"
    assert detect_tool_call_parser(None, "mistral") == "mistral"
    assert detect_tool_call_parser("{{ messages }}", None) == "hermes"


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_system_prompt_lists_tools_and_format(name):
    p = parser(name)
    prompt = p.system_prompt()
    for t in TOOLS:
        assert t.name in prompt
    example = p.render_calls([("get_weather", {"city": "..."})])
    assert example in prompt
    assert as_pairs(p.parse(example)) == [("get_weather", '{"city": "..."}')]


# ------------------------------------------------------------------------------------------------
# Structural tags: compiled by our backends, walked token by token with the default tokenizer.

GOOD_CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("search", {"query": "a 'quoted' \"text\" </b>\nline 2", "filters": {"max": 3, "tags": ["x"]}}),
    ("get_time", {}),
]
BAD_CALLS = {  # schema-violating arguments, an unknown tool
    "type": [("get_weather", {"city": "Paris", "days": "soon"})],
    "enum": [("get_weather", {"city": "Paris", "unit": "kelvin"})],
    "missing": [("get_weather", {"unit": "celsius"})],
    "unknown_tool": [("no_such_tool", {})],
}


# Calls with bad arguments in forms parse() accepts but render_calls() does not write: the auto
# grammar must not let them through as free text.
SNEAKY = {
    "hermes": '<tool_call>{"type": "function", "name":"get_weather","parameters":{"days":"x"}}</tool_call>',
    "llama3": '<|python_tag|>{"name":"get_weather","arguments":{"days":"x"}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"days": "x"}',
    "pythonic": "[ get_weather( days = 'x' ) ]",
    "qwen3_coder": "<tool_call><function=get_weather><parameter=days>x</parameter></function></tool_call>",
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"days": "x"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": '<|tool_calls_section_begin|> <|tool_call_begin|> get_weather <|tool_call_argument_begin|> {"days": "x"} <|tool_call_end|>'
    "<|tool_calls_section_end|>",
}
SNEAKY["qwen25"] = SNEAKY["hermes"]
SNEAKY["deepseek_v31"] = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"days": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


_backends: dict = {}


def backend(tokenizer, kind: str):
    from gramserve.grammar.backends import GrammarOptions, create_backend

    if kind not in _backends:
        _backends[kind] = create_backend(kind, tokenizer, len(tokenizer), [tokenizer.eos_token_id], GrammarOptions())
    return _backends[kind]


def accepts(b, compiled, text: str, tokenizer) -> bool:
    m = b.matcher(compiled)
    for tok in [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]:
        if not m.accept_token(tok):
            return False
    return m.is_terminated()


@pytest.mark.parametrize("kind", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_structural_tags_constrain_calls(tokenizer, kind, name):
    from gramserve.grammar.backends import GrammarSpec

    b = backend(tokenizer, kind)
    p = parser(name)

    def compiled(mode, parallel, function=None):
        return b.compile(GrammarSpec("structural_tag", json.dumps(p.structural_tag(mode, parallel, function))))

    one, two = p.render_calls(GOOD_CALLS[:1]), p.render_calls(GOOD_CALLS)
    bads = {k: p.render_calls(v) for k, v in BAD_CALLS.items()}

    required = compiled("required", True)
    for text, n in ((one, 1), (two, len(GOOD_CALLS))):
        assert accepts(b, required, text, tokenizer), text
        assert [c.name for c in p.parse(text).calls] == [c for c, _ in GOOD_CALLS[:n]]
    for text in ["", "Hello", "Hello " + one, *bads.values()]:
        assert not accepts(b, required, text, tokenizer), text

    single = compiled("required", False)
    assert accepts(b, single, one, tokenizer)
    assert not accepts(b, single, two, tokenizer)

    with pytest.raises(ValueError):
        p.structural_tag("named", True, "no_such_tool")
    named = compiled("named", True, "get_time")
    assert accepts(b, named, p.render_calls([("get_time", {})]), tokenizer)
    assert not accepts(b, named, one, tokenizer)

    auto = compiled("auto", True)
    for text in ["Just text.", one, two, "Let me check. " + one]:
        assert accepts(b, auto, text, tokenizer), text
        r = p.parse(text)
        assert len(r.calls) == (0 if text == "Just text." else len(GOOD_CALLS) if text == two else 1), (text, r)
    for text in bads.values():
        assert not accepts(b, auto, "Let me check. " + text, tokenizer), text
    assert p.parse(SNEAKY[name]).calls, SNEAKY[name]
    assert not accepts(b, auto, "Hi. " + SNEAKY[name], tokenizer)
    auto_single = compiled("auto", False)
    assert accepts(b, auto_single, "Hi. " + one, tokenizer)
    assert not accepts(b, auto_single, two, tokenizer)


@pytest.mark.parametrize("kind", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_bounded_calls(tokenizer, kind, name):
    """--max-parallel-tool-calls: with a bound of 2 a turn holds one or two calls, never three (required, and the
    calls after an auto trigger); the same grammar as without a bound otherwise."""
    from gramserve.grammar.backends import GrammarSpec

    b = backend(tokenizer, kind)
    p = parser(name)

    def compiled(mode):
        return b.compile(GrammarSpec("structural_tag", json.dumps(bound_calls(p.structural_tag(mode, True), 2))))

    one, two, three = (p.render_calls(GOOD_CALLS[:n]) for n in (1, 2, 3))
    required = compiled("required")
    assert accepts(b, required, one, tokenizer) and accepts(b, required, two, tokenizer)
    bounded = json.dumps(bound_calls(p.structural_tag("required", True), 2)) != json.dumps(
        p.structural_tag("required", True)
    )
    assert accepts(b, required, three, tokenizer) != bounded  # formats with no run of calls (pythonic) are unchanged
    assert not accepts(b, required, "", tokenizer)
    auto = compiled("auto")
    assert accepts(b, auto, "Just text.", tokenizer) and accepts(b, auto, "Let me check. " + one, tokenizer)
    assert bound_calls(p.structural_tag("required", True), 0) == p.structural_tag("required", True)


# A pydantic-style schema: $defs/$ref, anyOf, type lists, mixed enums, const, arrays of objects.
COMPLEX = ToolFunction(
    "t",
    {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
            "b": {"type": ["number", "null"]},
            "c": {"enum": [1, 2.5, "x", None, True]},
            "d": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
            "e": {"$ref": "#/$defs/Item"},
            "f": {"const": "fixed"},
            "g": {"type": "object"},
        },
        "required": ["a", "d"],
        "$defs": {"Item": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}},
    },
)


@pytest.mark.parametrize("kind", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_structural_tags_complex_schema(tokenizer, kind, name):
    from gramserve.grammar.backends import GrammarSpec

    b = backend(tokenizer, kind)
    p = parser(name, [COMPLEX])
    c = b.compile(GrammarSpec("structural_tag", json.dumps(p.structural_tag("required", True))))
    good = {"a": "s", "b": None, "c": 2.5, "d": [{"k": "v"}], "e": {"k": "w"}, "f": "fixed", "g": {"q": [1]}}
    text = p.render_calls([("t", good)])
    assert accepts(b, c, text, tokenizer), text
    assert [json.loads(x.arguments) for x in p.parse(text).calls] == [good]
    for bad in ({"a": 1, "c": 3, "d": []}, {"a": 1, "d": [{"j": "v"}]}, {"a": 1, "d": [], "e": {"k": 1}}, {"d": []}):
        assert not accepts(b, c, p.render_calls([("t", bad)]), tokenizer), bad


def test_inline_refs():
    from gramserve.parsers.tool_calls._schema import inline_refs

    assert inline_refs(COMPLEX.parameters)["properties"]["d"]["items"] == {
        "type": "object",
        "properties": {"k": {"type": "string"}},
        "required": ["k"],
    }
    tree = {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}},
        "$defs": {
            "Node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}
        },
    }
    out = inline_refs(tree)
    assert out["properties"]["root"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/Node"}
    assert out["$defs"] == tree["$defs"]


def test_long_arguments_stream_in_linear_time():
    """A 16 KB argument fed 4 characters at a time: the engine re-reads an open call on every chunk,
    so scans must resume where they stopped (about 0.1-0.4 s per parser here; the bound is loose)."""
    import time

    tools = [ToolFunction("write", {"type": "object", "properties": {"code": {"type": "string"}}})]
    code = "def f(x):\n    return {'a': [x, \"y\"]}\n" * 400
    start = time.perf_counter()
    for name in TOOL_CALL_PARSERS:
        p = parser(name, tools)
        text = p.render_calls([("write", {"code": code})])
        content, calls = stream(name, [text[i : i + 4] for i in range(0, len(text), 4)], tools)
        assert json.loads(calls[0][1]) == {"code": code}
    assert time.perf_counter() - start < 15


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "kimi_k2"])
def test_stop_strings_turn_off_at_a_call_start_not_at_plain_text(name):
    """`stop_until` (call_markers) is the parser's region start: a stop string keeps cutting text that only holds a
    grammar trigger ("See [1]" for pythonic's "[", a JSON example for llama3's '{"'), and stops cutting at a call."""
    import re

    from gramserve.server.tool_requests import ToolPlan, call_markers

    parser_cls = get_tool_call_parser(name)
    (pattern,) = call_markers(ToolPlan(TOOLS, "auto", None, True, parser_cls))
    call = parser_cls(TOOLS).render_calls([("get_weather", {"city": "Paris"})])
    assert re.search(pattern, "Sure.\n" + call), (name, call)
    assert not re.search(pattern, 'See [1] and {"x": 1}, then (2).'), name


@pytest.mark.parametrize("name", ["hermes", "pythonic", "qwen3_coder", "llama3"])
def test_history_arguments_that_are_not_an_object_render(name):
    """A call cut at max_tokens and sent back (its arguments not JSON) must render in every format: pythonic and
    qwen3_coder's renderers read the arguments as a dict (an AttributeError, a 500, when they stayed text)."""
    from gramserve.server import protocol as P
    from gramserve.server.tool_requests import ToolPlan, render_messages

    cut = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    messages = [
        P.ChatMessage(role="user", content="Weather?"),
        P.ChatMessage(role="assistant", content=None, tool_calls=[cut]),
        P.ChatMessage(role="tool", tool_call_id="c1", content="error: cut"),
    ]
    plan = ToolPlan(TOOLS, "auto", None, True, get_tool_call_parser(name))
    for native in (False, True):
        out, _ = render_messages(messages, plan, native, get_tool_call_parser(name))
        assert any(m["role"] == "assistant" for m in out), out
