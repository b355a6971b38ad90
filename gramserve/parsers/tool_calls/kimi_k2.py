"""Kimi K2 format::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The call id is ``functions.NAME:INDEX``; the name is taken from it."""

from __future__ import annotations

import json
from typing import ClassVar

import regex

from . import _structural as st
from ._scan import json_args_call, read_section
from .base import Region, ToolCallParser, ToolChoiceMode, grammar_parameters

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"


def _name_from_id(m: regex.Match) -> str | None:
    ident = m.group("id")
    if ident.startswith("functions."):
        ident = ident[len("functions.") :]
    head, colon, index = ident.rpartition(":")
    if colon and index.isdigit():
        ident = head
    return ident or None


_read_call = json_args_call(
    r"\s*" + regex.escape(CALL_BEGIN) + r"\s*(?P<id>[^\s<]+)\s*" + regex.escape(ARGS_BEGIN) + r"\s*",
    r"\s*" + regex.escape(CALL_END),
    _name_from_id,
)


class KimiK2ToolCallParser(ToolCallParser):
    name: ClassVar[str] = "kimi_k2"
    start_pattern: ClassVar[str] = regex.escape(SECTION_BEGIN)
    markers: ClassVar[tuple[str, ...]] = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

    def _parse_region(self, text: str, start: int) -> Region:
        return read_section(
            text, start, _read_call, open=regex.escape(SECTION_BEGIN), close=r"\s*" + regex.escape(SECTION_END)
        )

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = "".join(
            f"{CALL_BEGIN}functions.{n}:{i}{ARGS_BEGIN}{json.dumps(a, ensure_ascii=False)}{CALL_END}"
            for i, (n, a) in enumerate(calls)
        )
        return SECTION_BEGIN + body + SECTION_END

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(
                f"{CALL_BEGIN}functions.{t.name}:",
                st.sequence(
                    {"type": "regex", "pattern": "[0-9]+"}, st.const(ARGS_BEGIN), st.json_schema(grammar_parameters(t))
                ),
                CALL_END,
            )
            for t in self._tools_for(mode, function)
        ]
        return st.section_format(mode, parallel, tags, begin=SECTION_BEGIN, end=SECTION_END, separator="")
