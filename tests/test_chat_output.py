"""One choice's text -> OpenAI message fields (server/chat_output.py): repeated and cut calls, no model."""

from __future__ import annotations

import json

from gramserve.parsers.tool_calls import get_tool_call_parser
from gramserve.parsers.tool_calls.base import ToolFunction
from gramserve.server.chat_output import ChoiceStream, final_output
from gramserve.server.tool_requests import ToolPlan

TOOLS = [
    ToolFunction("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),
    ToolFunction("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}}),
]


def plan() -> ToolPlan:
    return ToolPlan(TOOLS, "required", None, True, get_tool_call_parser("hermes"))


def call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>\n"


def stream(text: str, chunk: int = 3, cut: bool = False):
    cs = ChoiceStream(plan(), None)
    deltas = []
    for i in range(0, len(text), chunk):
        deltas += cs.feed(text[i : i + chunk]).tool_calls
        if cs.repeated:
            return cs, deltas
    deltas += cs.finish(cut=cut).tool_calls
    return cs, deltas


def accumulate(deltas) -> list[tuple[str, dict]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        e = calls.setdefault(d.index, ["", ""])
        e[0] += d.function.name or ""
        e[1] += d.function.arguments or ""
    return [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def test_distinct_calls_all_stream():
    text = (
        call("get_weather", {"city": "Paris"})
        + call("get_time", {"tz": "Asia/Tokyo"})
        + call("get_weather", {"city": "Rome"})
    )
    cs, deltas = stream(text)
    assert not cs.repeated and cs.calls_made == 3
    assert accumulate(deltas) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Asia/Tokyo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    # The first call streams in pieces; later ones come once complete.
    assert sum(d.index == 0 for d in deltas) > 2


def test_a_repeated_call_ends_the_choice_and_is_never_sent():
    text = call("get_weather", {"city": "Paris"}) + call("get_time", {"tz": "UTC"})
    text += call("get_weather", {"city": "Paris"}).replace(", ", ",  ") + call("get_time", {"tz": "X"})
    cs, deltas = stream(text)
    assert cs.repeated
    assert accumulate(deltas) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    out = final_output(text, plan(), None, cut=True)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] == accumulate(deltas)
    assert out.content is None


def test_a_cut_call_is_dropped_not_content():
    text = call("get_weather", {"city": "Paris"}) + '<tool_call>\n{"name": "get_time", "argu'
    out = final_output(text, plan(), None, cut=True)
    assert [c.function.name for c in out.tool_calls] == ["get_weather"] and out.content is None
    cs, deltas = stream(text, cut=True)
    assert accumulate(deltas) == [("get_weather", {"city": "Paris"})]
    only_cut = final_output('<tool_call>\n{"name', plan(), None, cut=True)
    assert only_cut.tool_calls is None and only_cut.content is None
    # Not cut (the model ended there): the malformed text stays content, as before.
    assert final_output('<tool_call>\n{"name', plan(), None).content == '<tool_call>\n{"name'
