"""Hermes / Qwen2.5 format: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one
block per call."""

from __future__ import annotations

import json
from typing import ClassVar

from . import _structural as st
from ._scan import JSON_CALL_HEAD, json_args_call, json_name
from .base import Region, ToolCallParser, ToolChoiceMode, grammar_parameters

_read_call = json_args_call(r"<tool_call>\s*" + JSON_CALL_HEAD, r"\s*\}\s*</tool_call>", json_name)


class HermesToolCallParser(ToolCallParser):
    name: ClassVar[str] = "hermes"
    start_pattern: ClassVar[str] = r"<tool_call>"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>")

    def _parse_region(self, text: str, start: int) -> Region:
        # One call per region; the next <tool_call> starts its own region.
        status, snap, end = _read_call(text, start)
        return Region(status, [snap] if snap else [], end)

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
            for n, a in calls
        )

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(
                '<tool_call>\n{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "arguments": ',
                st.json_schema(grammar_parameters(t)),
                "}\n</tool_call>",
            )
            for t in self._tools_for(mode, function)
        ]
        return st.calls_format(mode, parallel, tags, trigger="<tool_call>", separator="\n")


class Qwen25ToolCallParser(HermesToolCallParser):
    """Qwen2.5's chat template uses the Hermes format unchanged."""

    name: ClassVar[str] = "qwen25"


__all__ = ["HermesToolCallParser", "Qwen25ToolCallParser"]
