"""Tool-call parsers: one class per model output format, chosen by name (``--tool-call-parser``).

parser = get_tool_call_parser("hermes")(tools)
result = parser.parse(text)                 # ParseResult(content, calls)
delta = parser.feed(chunk); ...; parser.finish()   # streaming, one parser object per response
parser.structural_tag("auto", parallel=True)       # grammar for constrained calls
bound_calls(tag, 16)                               # ... with at most 16 calls in a turn
"""

from __future__ import annotations

from ._structural import bound_calls
from .base import (
    ParseResult,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolChoiceMode,
    ToolFunction,
)
from .deepseek_v3 import DeepSeekV3ToolCallParser, DeepSeekV31ToolCallParser
from .hermes import HermesToolCallParser, Qwen25ToolCallParser
from .kimi_k2 import KimiK2ToolCallParser
from .llama3 import Llama3ToolCallParser
from .mistral import MistralToolCallParser
from .pythonic import PythonicToolCallParser
from .qwen3_coder import Qwen3CoderToolCallParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls
    for cls in (
        HermesToolCallParser,
        Qwen25ToolCallParser,
        Llama3ToolCallParser,
        MistralToolCallParser,
        PythonicToolCallParser,
        Qwen3CoderToolCallParser,
        DeepSeekV3ToolCallParser,
        DeepSeekV31ToolCallParser,
        KimiK2ToolCallParser,
    )
}


def get_tool_call_parser(name: str) -> type[ToolCallParser]:
    key = name.replace("-", "_").lower()
    if key not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[key]


# Chat-template markers, most specific first.
_TEMPLATE_MARKERS = (
    ("<function=", "qwen3_coder"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
    ("<|python_start|>", "pythonic"),
    ("[func_name1(", "pythonic"),
    ("<tool_call>", "hermes"),
)

_MODEL_TYPES = {
    "qwen2": "qwen25",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3",
    "mistral": "mistral",
    "mistral3": "mistral",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "kimi_k2",
    "llama4": "pythonic",
}


def detect_tool_call_parser(chat_template: str | None, model_type: str | None) -> str:
    """A default parser name from the chat template text (else the model type); "hermes" if unknown."""
    template = chat_template or ""
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            if name == "qwen3_coder" and "<tool_call>" not in template:
                continue
            if name == "hermes" and (model_type or "").lower() == "qwen2":
                return "qwen25"
            return name
    return _MODEL_TYPES.get((model_type or "").lower(), "hermes")


__all__ = [
    "bound_calls",
    "TOOL_CALL_PARSERS",
    "ParseResult",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolChoiceMode",
    "ToolFunction",
    "detect_tool_call_parser",
    "get_tool_call_parser",
]
