"""Llama 3.1/3.2 JSON format: ``{"name": "f", "parameters": {...}}``, optionally after
``<|python_tag|>``, several calls separated by ``;``.

A call object must open with ``{"`` (no whitespace: that is how the models write it), so that the
``auto`` grammar, which triggers on ``{"``, constrains every object the parser would read as a call."""

from __future__ import annotations

import json
from typing import ClassVar

from . import _structural as st
from ._scan import JSON_CALL_HEAD, json_args_call, json_name, read_section
from .base import Region, ToolCallParser, ToolChoiceMode, grammar_parameters

PYTHON_TAG = "<|python_tag|>"
_read_call = json_args_call(r"\{" + JSON_CALL_HEAD[len(r"\{\s*") :], r"\s*\}", json_name)


class Llama3ToolCallParser(ToolCallParser):
    name: ClassVar[str] = "llama3"
    # <|python_tag|>, or a JSON object whose first key is "name" (or "type").
    start_pattern: ClassVar[str] = r'<\|python_tag\|>|\{"(?:name|type)"\s*:'
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)

    def _parse_region(self, text: str, start: int) -> Region:
        return read_section(text, start, _read_call, open=r"(?:<\|python_tag\|>)?\s*", sep=r"\s*;\s*")

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(
                '{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "parameters": ',
                st.json_schema(grammar_parameters(t)),
                "}",
            )
            for t in self._tools_for(mode, function)
        ]
        return st.calls_format(mode, parallel, tags, trigger='{"', separator="; ")
