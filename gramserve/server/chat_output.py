"""Function calling and reasoning on the response side: one choice's generated text -> OpenAI message fields.

The text goes through the reasoning parser first (reasoning_content vs the rest), then through the tool-call
parser (content vs tool_calls). `ChoiceOutput.final` does it once for a whole text; `ChoiceStream.feed` does it
incrementally and yields delta fields in the shape the OpenAI SDK accumulates: a call's first delta carries
`index`, `id`, `type` and `function.name` (with `arguments: ""`), later ones `index` and argument fragments.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gramserve.parsers.reasoning import ReasoningParser
from gramserve.parsers.tool_calls import ToolCallParser
from gramserve.server import protocol as P
from gramserve.server.tool_requests import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(base: str | None, plan: ToolPlan | None, made_calls: bool) -> str | None:
    """OpenAI's reasons: a finished answer that called tools is `tool_calls` (auto / required), `stop` for a
    named function; `length` stays `length` (a truncated call)."""
    if base == "stop" and made_calls and plan is not None and plan.mode != "named":
        return "tool_calls"
    return base


@dataclass
class ChoiceOutput:
    """Whole-text post-processing of one choice."""

    reasoning_content: str | None
    content: str | None
    tool_calls: list[P.ToolCall] | None


def final_output(text: str | None, plan: ToolPlan | None, reasoning: ReasoningParser | None) -> ChoiceOutput:
    reasoning_text = None
    if reasoning is not None:
        reasoning_text, content = reasoning.parse(text)
        text = content if content is not None or reasoning_text is None else None
    if plan is None or not plan.parses_calls or text is None:
        return ChoiceOutput(reasoning_text, text, None)
    parsed = plan.new_parser().parse(text)
    calls = [
        P.ToolCall(id=call_id(), function=P.FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls
    ]
    if not calls:
        return ChoiceOutput(reasoning_text, text, None)
    return ChoiceOutput(reasoning_text, parsed.content, calls)


@dataclass
class DeltaFields:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[P.DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)

    def message(self) -> P.DeltaMessage:
        return P.DeltaMessage(
            reasoning_content=self.reasoning_content or None,
            content=self.content or None,
            tool_calls=self.tool_calls or None,
        )


class ChoiceStream:
    """Incremental post-processing of one streamed choice."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None):
        self.plan = plan
        self.reasoning = reasoning
        self.tools: ToolCallParser | None = plan.new_parser() if plan is not None and plan.parses_calls else None
        self.calls_made = 0

    def feed(self, text: str) -> DeltaFields:
        out = DeltaFields()
        if self.reasoning is not None:
            out.reasoning_content, text = self.reasoning.feed(text)
        self._content(text, out, final=False)
        return out

    def finish(self) -> DeltaFields:
        out = DeltaFields()
        text = ""
        if self.reasoning is not None:
            out.reasoning_content, text = self.reasoning.finish()
        self._content(text, out, final=True)
        return out

    def _content(self, text: str, out: DeltaFields, final: bool) -> None:
        if self.tools is None:
            out.content += text
            return
        pieces = [self.tools.feed(text)] if text else []
        if final:
            pieces.append(self.tools.finish())
        for piece in pieces:
            out.content += piece.content
            for d in piece.calls:
                if d.name is not None:
                    self.calls_made += 1
                    out.tool_calls.append(
                        P.DeltaToolCall(
                            index=d.index,
                            id=call_id(),
                            type="function",
                            function=P.DeltaFunctionCall(name=d.name, arguments=d.arguments or ""),
                        )
                    )
                elif d.arguments:
                    out.tool_calls.append(
                        P.DeltaToolCall(index=d.index, function=P.DeltaFunctionCall(arguments=d.arguments))
                    )
