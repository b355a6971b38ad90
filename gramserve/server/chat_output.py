"""Function calling and reasoning on the response side: one choice's generated text -> OpenAI message fields.

The text goes through the reasoning parser first (reasoning_content vs the rest), then through the tool-call
parser (content vs tool_calls). `ChoiceOutput.final` does it once for a whole text; `ChoiceStream.feed` does it
incrementally and yields delta fields in the shape the OpenAI SDK accumulates: a call's first delta carries
`index`, `id`, `type` and `function.name` (with `arguments: ""`), later ones `index` and argument fragments.

Runaway calls: a small model asked for calls tends to repeat its first call until max_tokens. A call equal to one
already made in the turn (same name, same arguments as JSON) ends the choice: it is dropped, the choice finishes as
`tool_calls`, and the caller aborts its engine request (`ChoiceStream.repeated`). So that a repeat is never sent,
streamed calls after the first are held back until their arguments are complete. A call cut by max_tokens (or an
abort) is dropped, never returned as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from gramserve.parsers.reasoning import ReasoningParser
from gramserve.parsers.tool_calls import ToolCallParser
from gramserve.parsers.tool_calls.base import ToolCall
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


def call_signature(call: ToolCall) -> tuple[str, str]:
    """What makes two calls the same call: the name and the arguments as JSON (key order and spacing aside)."""
    try:
        return call.name, json.dumps(json.loads(call.arguments), sort_keys=True)
    except ValueError:
        return call.name, call.arguments


def first_calls_until_repeat(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls up to (not including) the first one equal to an earlier call."""
    seen: set[tuple[str, str]] = set()
    for i, c in enumerate(calls):
        sig = call_signature(c)
        if sig in seen:
            return calls[:i]
        seen.add(sig)
    return calls


def final_output(
    text: str | None, plan: ToolPlan | None, reasoning: ReasoningParser | None, cut: bool = False
) -> ChoiceOutput:
    """`cut`: the text was cut off (max_tokens, an abort), so a call cut in the middle is dropped."""
    reasoning_text = None
    if reasoning is not None:
        reasoning_text, content = reasoning.parse(text)
        text = content if content is not None or reasoning_text is None else None
    if plan is None or not plan.parses_calls or text is None:
        return ChoiceOutput(reasoning_text, text, None)
    parsed = plan.new_parser().parse(text, cut=cut)
    calls = [
        P.ToolCall(id=call_id(), function=P.FunctionCall(name=c.name, arguments=c.arguments))
        for c in first_calls_until_repeat(parsed.calls)
    ]
    return ChoiceOutput(reasoning_text, parsed.content, calls or None)


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
        self.repeated = False  # a call equal to an earlier one completed: the choice ends here
        self._held: dict[int, list[P.DeltaToolCall]] = {}  # deltas of calls after the first, until complete
        self._signatures: set[tuple[str, str]] = set()
        self._checked = 0  # completed calls looked at

    def feed(self, text: str) -> DeltaFields:
        out = DeltaFields()
        if self.repeated:
            return out
        if self.reasoning is not None:
            out.reasoning_content, text = self.reasoning.feed(text)
        self._content(text, out, final=False)
        return out

    def finish(self, cut: bool = False) -> DeltaFields:
        """The end of the choice; `cut`: it was cut off (max_tokens, an abort)."""
        out = DeltaFields()
        if self.repeated:
            return out
        text = ""
        if self.reasoning is not None:
            out.reasoning_content, text = self.reasoning.finish()
        self._content(text, out, final=True, cut=cut)
        self._held.clear()  # calls that never completed
        return out

    def _content(self, text: str, out: DeltaFields, final: bool, cut: bool = False) -> None:
        if self.tools is None:
            out.content += text
            return
        pieces = [self.tools.feed(text)] if text else []
        if final:
            pieces.append(self.tools.finish(cut=cut))
        for piece in pieces:
            out.content += piece.content
            for d in piece.calls:
                if d.name is not None:
                    delta = P.DeltaToolCall(
                        index=d.index,
                        id=call_id(),
                        type="function",
                        function=P.DeltaFunctionCall(name=d.name, arguments=d.arguments or ""),
                    )
                elif d.arguments:
                    delta = P.DeltaToolCall(index=d.index, function=P.DeltaFunctionCall(arguments=d.arguments))
                else:
                    continue
                if d.index == 0:  # the first call cannot repeat anything: it streams as it comes
                    self.calls_made += d.name is not None
                    out.tool_calls.append(delta)
                else:
                    self._held.setdefault(d.index, []).append(delta)
        self._release(out)

    def _release(self, out: DeltaFields) -> None:
        """Send the held deltas of calls that completed, unless one repeats an earlier call."""
        done = self.tools.completed_calls
        while self._checked < len(done):
            k = self._checked
            self._checked += 1
            sig = call_signature(done[k])
            if sig in self._signatures:
                self.repeated = True
                self._held.clear()
                return
            self._signatures.add(sig)
            held = self._held.pop(k, [])
            self.calls_made += any(d.id is not None for d in held)
            out.tool_calls += _one_delta(held)


def _one_delta(deltas: list[P.DeltaToolCall]) -> list[P.DeltaToolCall]:
    """A held call's deltas as one entry (its id, name and whole arguments), as a client reads one call's delta."""
    if len(deltas) < 2:
        return deltas
    first = next((d for d in deltas if d.id is not None), deltas[0])
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    name = first.function.name if first.function is not None else None
    return [
        P.DeltaToolCall(
            index=first.index,
            id=first.id,
            type=first.type,
            function=P.DeltaFunctionCall(name=name, arguments=arguments),
        )
    ]
