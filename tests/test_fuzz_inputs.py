"""Property tests (hypothesis): request validation and the output parsers take anything without raising.

- The sampling-parameter builders turn any JSON value into valid SamplingParams or a 400 error
  (InvalidRequestError / SamplingParamsError), never another exception.
- The request models accept or refuse any JSON object with a ValidationError, never another exception.
- Every tool-call parser and reasoning parser takes arbitrary text (built from its own markers, JSON
  punctuation and tool names, so the interesting paths are reached) without raising; calls it returns have
  JSON-object arguments; the streamed reading of any split of the text agrees with the one-shot parse.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gramserve.parsers.reasoning import get_reasoning_parser
from gramserve.parsers.tool_calls import TOOL_CALL_PARSERS, ToolFunction, get_tool_call_parser
from gramserve.sampling.params import SamplingParamsError
from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError
from gramserve.server.sampling_request import native_sampling_params, openai_sampling_params

VOCAB = 49152
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=10,
)
SAMPLING_KEYS = [
    "max_tokens",
    "max_new_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "seed",
    "sampling_seed",
    "logit_bias",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "priority",
]
sampling_dicts = st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values, max_size=6)


@FAST
@given(sampling_dicts)
def test_native_sampling_params_are_built_or_refused(fields):
    fields = {k: v for k, v in fields.items() if k not in ("max_tokens", "min_tokens", "n", "priority")}
    try:
        params = native_sampling_params(fields, VOCAB)
    except (InvalidRequestError, SamplingParamsError):
        return
    params.validate(VOCAB)  # what it returns is valid


@FAST
@given(sampling_dicts)
def test_chat_requests_are_parsed_or_refused(fields):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    try:
        req = P.ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return
    try:
        params = openai_sampling_params(req, VOCAB)
    except (InvalidRequestError, SamplingParamsError):
        return
    params.validate(VOCAB)
    assert params.seed is None or -(2**63) <= params.seed < 2**64


@FAST
@given(st.dictionaries(st.sampled_from(["text", "input_ids", "rid", "top_logprobs_num", "stream"]), json_values))
def test_generate_requests_are_parsed_or_refused(body):
    try:
        P.GenerateRequest.model_validate(body)
    except ValidationError:
        pass


TOOLS = [
    ToolFunction("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
    ToolFunction("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
]
JSON_BITS = ['{"', '"}', '": ', ", ", "{", "}", "[", "]", '"', "\\", "\n", "get_weather", "add", "city", "Paris", "1"]


def _fragments(markers: tuple[str, ...]) -> st.SearchStrategy[str]:
    pieces = list(markers) + JSON_BITS + ['"name": ', '"arguments": ', "(", ")", "=", "<", ">", "[TOOL_CALLS]"]
    return st.lists(st.one_of(st.sampled_from(pieces), st.text(max_size=3)), max_size=14).map("".join)


def _stream(name: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p = get_tool_call_parser(name)(TOOLS)
    content, calls = "", []
    for d in [p.feed(c) for c in chunks] + [p.finish()]:
        content += d.content
        for c in d.calls:
            if c.name is not None:
                calls.append([c.name, ""])
            else:
                calls[c.index][1] += c.arguments
    return content, [tuple(c) for c in calls]


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_tool_call_parsers_take_any_text(name):
    cls = get_tool_call_parser(name)

    call = cls(TOOLS).render_calls([("get_weather", {"city": "Paris"})])

    @FAST
    @given(_fragments(cls.markers), _fragments(cls.markers), st.booleans(), st.lists(st.integers(0, 90), max_size=4))
    def check(before, after, with_call, cuts):
        text = before + (call if with_call else "") + after
        result = cls(TOOLS).parse(text)
        for c in result.calls:
            assert isinstance(json.loads(c.arguments), dict)
        content, calls = _stream(name, _split(text, cuts))
        complete = [(c.name, c.arguments) for c in result.calls]
        assert [c for c in calls if c in complete] == complete, (text, calls, complete)
        if not calls and not result.calls:
            assert content.strip() == (result.content or ""), text

    check()


@pytest.mark.parametrize("name", ["deepseek-r1", "qwen3", "qwen3-thinking"])
def test_reasoning_parsers_take_any_text(name):
    cls = get_reasoning_parser(name)

    @FAST
    @given(
        _fragments((cls.start_marker, cls.end_marker)),
        st.lists(st.integers(0, 60), max_size=4),
        st.booleans(),
    )
    def check(text, cuts, thinking):
        reasoning, content = cls({"enable_thinking": thinking}).parse(text)
        streamed = cls({"enable_thinking": thinking})
        r = c = ""
        for chunk in _split(text, cuts):
            dr, dc = streamed.feed(chunk)
            r, c = r + dr, c + dc
        dr, dc = streamed.finish()
        assert ((r + dr) or None, (c + dc) or None) == (reasoning, content), text

    check()
