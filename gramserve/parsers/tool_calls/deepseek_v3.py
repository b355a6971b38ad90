"""DeepSeek V3 format::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(fullwidth bars ``｜`` and ``▁`` as in DeepSeek's tokenizer). Parsing also accepts DeepSeek V3.1's
calls, ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``, in the same
section; ``deepseek_v31`` renders and constrains that form."""

from __future__ import annotations

import json
from typing import ClassVar

from . import _structural as st
from ._scan import json_args_call, plain_name, read_section
from .base import Region, ToolCallParser, ToolChoiceMode, grammar_parameters

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_read_v3_call = json_args_call(
    r"\s*" + CALL_BEGIN + r"\s*function\s*" + SEP + r"\s*(?P<name>[^\s<`]+)\s*```(?:json)?[ \t\r]*\n\s*",
    r"\s*```\s*" + CALL_END,
    plain_name,
)
_read_v31_call = json_args_call(
    r"\s*" + CALL_BEGIN + r"\s*(?P<name>[^\s<]+?)\s*" + SEP + r"\s*", r"\s*" + CALL_END, plain_name
)


def _read_call(text: str, pos: int):
    # The V3 head is tried first: a V3.1 call makes it invalid before it has read a name.
    first = _read_v3_call(text, pos)
    return first if first[0] != "invalid" else _read_v31_call(text, pos)


class DeepSeekV3ToolCallParser(ToolCallParser):
    name: ClassVar[str] = "deepseek_v3"
    start_pattern: ClassVar[str] = CALLS_BEGIN
    markers: ClassVar[tuple[str, ...]] = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def _parse_region(self, text: str, start: int) -> Region:
        return read_section(text, start, _read_call, open=CALLS_BEGIN, close=r"\s*" + CALLS_END)

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = "\n".join(
            f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```{CALL_END}"
            for n, a in calls
        )
        return CALLS_BEGIN + body + CALLS_END

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(
                f"{CALL_BEGIN}function{SEP}{t.name}\n```json\n",
                st.json_schema(grammar_parameters(t)),
                f"\n```{CALL_END}",
            )
            for t in self._tools_for(mode, function)
        ]
        return st.section_format(mode, parallel, tags, begin=CALLS_BEGIN, end=CALLS_END, separator="\n")


class DeepSeekV31ToolCallParser(DeepSeekV3ToolCallParser):
    name: ClassVar[str] = "deepseek_v31"

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = "".join(f"{CALL_BEGIN}{n}{SEP}{json.dumps(a, ensure_ascii=False)}{CALL_END}" for n, a in calls)
        return CALLS_BEGIN + body + CALLS_END

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tags = [
            st.tag(f"{CALL_BEGIN}{t.name}{SEP}", st.json_schema(grammar_parameters(t)), CALL_END)
            for t in self._tools_for(mode, function)
        ]
        return st.section_format(mode, parallel, tags, begin=CALLS_BEGIN, end=CALLS_END, separator="")
