"""Mistral format: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` and the newer
``[TOOL_CALLS]f[ARGS]{...}`` (one ``[TOOL_CALLS]`` per call; an optional ``[CALL_ID]id`` before
``[ARGS]`` is accepted). Grammars force the array form."""

from __future__ import annotations

import json
from typing import ClassVar

from . import _structural as st
from ._scan import JSON_CALL_HEAD, json_args_call, json_name, plain_name, read_section
from .base import Region, ToolCallParser, ToolChoiceMode, grammar_parameters

TOOL_CALLS = "[TOOL_CALLS]"
_read_array_call = json_args_call(JSON_CALL_HEAD, r"\s*\}", json_name)
_read_named_call = json_args_call(
    r"\[TOOL_CALLS\]\s*(?P<name>[A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?\[ARGS\]\s*", None, plain_name
)


class MistralToolCallParser(ToolCallParser):
    name: ClassVar[str] = "mistral"
    start_pattern: ClassVar[str] = r"\[TOOL_CALLS\]"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS, "[ARGS]")

    def _parse_region(self, text: str, start: int) -> Region:
        rest = text[start + len(TOOL_CALLS) :].lstrip()
        if not rest:
            return Region("partial", [], start)
        if rest[0] == "[":
            return read_section(
                text, start, _read_array_call, open=r"\[TOOL_CALLS\]\s*\[\s*", sep=r"\s*,\s*", close=r"\s*\]"
            )
        status, snap, end = _read_named_call(text, start)
        return Region(status, [snap] if snap else [], end)

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return TOOL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(
                '{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "arguments": ',
                st.json_schema(grammar_parameters(t)),
                "}",
            )
            for t in self._tools_for(mode, function)
        ]
        # Trigger on [TOOL_CALLS] alone: free text must not hold the [TOOL_CALLS]name[ARGS] form either.
        return st.section_format(
            mode, parallel, tags, begin=TOOL_CALLS + "[", end="]", separator=", ", trigger=TOOL_CALLS
        )
