"""Qwen3-Coder XML format::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text (one newline after the opening and before the closing tag is not part
of it), typed by the tool's parameter schema (``_coerce``). The arguments are
``json.dumps(dict, ensure_ascii=False)`` of the parameters in order of appearance (a repeated
parameter makes the call invalid); streaming emits each parameter once it is closed, and
string-typed values as they arrive."""

from __future__ import annotations

import json
from typing import ClassVar

import regex

from .._text import partial_suffix
from . import _structural as st
from ._coerce import coerce, schema_types
from .base import CallSnapshot, Region, ToolCallParser, ToolChoiceMode, ToolFunction, grammar_parameters

_HEAD = regex.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>", regex.S)
_PARAM = regex.compile(r"\s*<parameter=(?P<key>[^>\n]+)>", regex.S)
_PARAM_END = "</parameter>"
_FUNC_END = regex.compile(r"\s*</function>", regex.S)
_CALL_END = regex.compile(r"\s*</tool_call>", regex.S)


def _dump(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def _text_so_far(raw: str) -> str:
    """The part of an unfinished string value that is certain: without a partial closing tag,
    the first newline, and a last newline (which may be the one before the closing tag)."""
    raw = raw[: len(raw) - partial_suffix(raw, _PARAM_END)]
    return _strip_one_newline(raw)


def _strip_one_newline(v: str) -> str:
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


class Qwen3CoderToolCallParser(ToolCallParser):
    name: ClassVar[str] = "qwen3_coder"
    start_pattern: ClassVar[str] = r"<tool_call>"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")

    def __init__(self, tools: list[ToolFunction]):
        super().__init__(tools)
        # Per tool, the property schemas that type the values ($refs inlined).
        self._properties: dict[str, dict] = {}
        for t in self.tools:
            props = grammar_parameters(t).get("properties")
            self._properties[t.name] = props if isinstance(props, dict) else {}

    def _parse_region(self, text: str, start: int) -> Region:
        m = _HEAD.match(text, start, partial=True)
        if m is None:
            return Region("invalid", [], start)
        if m.partial:
            return Region("partial", [], start)
        name = m.group("name").strip()
        props = self._properties.get(name, {})
        items: list[str] = []  # '"key": value' in order of appearance
        keys: set[str] = set()
        pos = m.end()
        while True:
            head = "{" + ", ".join(items)
            fe = _FUNC_END.match(text, pos, partial=True)
            if fe is not None and not fe.partial:
                snap = CallSnapshot(name, head + "}", True)
                ce = _CALL_END.match(text, fe.end(), partial=True)
                if ce is None:
                    return Region("invalid", [snap], fe.end())
                return Region("partial" if ce.partial else "done", [snap], fe.end() if ce.partial else ce.end())
            p = _PARAM.match(text, pos, partial=True)
            if p is None or p.partial:
                status = "partial" if (p is not None or fe is not None) else "invalid"
                return Region(status, [CallSnapshot(name, head)], pos)
            key = p.group("key").strip()
            if key in keys:
                return Region("invalid", [CallSnapshot(name, head)], pos)
            close = text.find(_PARAM_END, p.end())
            if close < 0:
                if schema_types(props.get(key)) == {"string"}:
                    head += (", " if items else "") + _dump(key) + ': "' + _dump(_text_so_far(text[p.end() :]))[1:-1]
                return Region("partial", [CallSnapshot(name, head)], pos)
            keys.add(key)
            value = coerce(_strip_one_newline(text[p.end() : close]), props.get(key))
            items.append(_dump(key) + ": " + _dump(value))
            pos = close + len(_PARAM_END)

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        def value(v) -> str:
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        return "\n".join(
            f"<tool_call>\n<function={n}>\n"
            + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>"
            for n, a in calls
        )

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(
                f"<tool_call>\n<function={t.name}>\n",
                _params_format(grammar_parameters(t)),
                "</function>\n</tool_call>",
            )
            for t in self._tools_for(mode, function)
        ]
        return st.calls_format(mode, parallel, tags, trigger="<tool_call>", separator="\n")


_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?"


def _value_format(schema, defs: dict) -> dict:
    types = schema_types(schema)
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
        forms = dict.fromkeys(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in schema["enum"])
        return {"type": "or", "elements": [st.const(f) for f in forms]}
    if isinstance(schema, dict) and "$ref" in schema:
        return st.json_schema({**schema, **defs})
    if not types or "string" in types:
        return {"type": "any_text"}
    if types == {"integer"}:
        return {"type": "regex", "pattern": r"-?(0|[1-9][0-9]*)"}
    if types <= {"integer", "number"}:
        return {"type": "regex", "pattern": _NUMBER}
    if types == {"boolean"}:
        return {"type": "regex", "pattern": "true|false"}
    if types == {"null"}:
        return st.const("null")
    return st.json_schema({**schema, **defs} if isinstance(schema, dict) else {})


def _params_format(parameters: dict) -> dict:
    """Parameters in schema order (required ones must appear). A value ends at the first
    ``</parameter>``, as when parsing; string values are any text (the newline before the closing
    tag is part of the text and dropped by the parser), others a newline-terminated literal."""
    props = parameters.get("properties")
    if not isinstance(props, dict) or not props:
        return st.const("")
    required = set(parameters.get("required") or [])
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}  # for $ref in values
    elements = []
    for k, s in props.items():
        value = _value_format(s, defs)
        if value.get("type") != "any_text":
            value = st.sequence(value, st.const("\n"))
        t = st.sequence(st.tag(f"<parameter={k}>\n", value, "</parameter>"), st.const("\n"))
        elements.append(t if k in required else {"type": "optional", "content": t})
    return st.sequence(*elements) if len(elements) > 1 else elements[0]
