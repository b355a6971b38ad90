"""Tool-call parser interface: the data types and the :class:`ToolCallParser` base class.

A parser sees the model output as free text with *call regions* in it (``<tool_call>...</tool_call>``,
``[TOOL_CALLS]...``, ``[f(a=1)]`` ...). Subclasses say where a region may start
(:meth:`ToolCallParser._find_region`) and how to read one (:meth:`ToolCallParser._parse_region`); the
shared engine in ``_engine`` turns that into the one-shot :meth:`parse` and the incremental
:meth:`feed`/:meth:`finish`, so that both agree for any split of the text into chunks.

Content semantics (one-shot and streaming alike): the text outside well-formed calls, concatenated,
with leading and trailing whitespace removed (``str.strip``); ``None`` in :class:`ParseResult` when
empty. Streaming emits exactly that string in pieces (whitespace is held back until non-whitespace
content follows it). A region that turns out malformed is text, unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import regex

ToolChoiceMode = Literal["auto", "required", "named"]

# A function given without parameters takes none (OpenAI: "an empty parameter list"): its arguments are {}.
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolFunction:
    name: str
    parameters: dict  # JSON Schema of the arguments object
    description: str | None = None
    strict: bool = False


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ParseResult:
    content: str | None  # text outside the calls, stripped; None when empty
    calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    index: int  # 0, 1, 2 ... per call, in order of appearance
    name: str | None = None  # only on the first delta of a call (whose arguments are then "")
    arguments: str = ""  # a fragment of the arguments JSON text


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class CallSnapshot:
    """What is known of one call of a region so far."""

    name: str | None = None  # set once the name is complete
    args: str = ""  # a prefix of the final arguments text that can no longer change
    done: bool = False  # args is the complete, valid arguments text


@dataclass
class Region:
    """The reading of a call region: ``partial`` (needs more text), ``done`` or ``invalid``."""

    status: Literal["partial", "done", "invalid"]
    calls: list[CallSnapshot] = field(default_factory=list)
    end: int = 0  # done: index just past the region; invalid: where it broke


class ToolCallParser(ABC):
    """Parses one response. ``parse`` is stateless; ``feed``/``finish`` keep per-response state."""

    name: ClassVar[str]
    # Regex (``regex`` module syntax) matching the start of a call region.
    start_pattern: ClassVar[str]
    # Marker strings of the format that some tokenizers make single special tokens: the grammar worker
    # lets those tokens stand for their text, so a constrained call can use them.
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[ToolFunction]):
        from ._engine import Engine

        self.tools = list(tools)
        self.tool_map = {t.name: t for t in self.tools}
        self._start_re = regex.compile(self.start_pattern, regex.S)
        self._stream = Engine(self, transactional=False)

    # -- public API ------------------------------------------------------------------------------

    def parse(self, text: str, cut: bool = False) -> ParseResult:
        """``cut``: the text was cut off (max_tokens, an abort): a call cut in the middle is dropped, not content."""
        from ._engine import Engine

        engine = Engine(self, transactional=True)
        delta = engine.run(text, final=True, cut=cut)
        return ParseResult(content=delta.content or None, calls=engine.completed)

    def feed(self, delta: str) -> StreamDelta:
        return self._stream.run(delta, final=False)

    def finish(self, cut: bool = False) -> StreamDelta:
        return self._stream.run("", final=True, cut=cut)

    @property
    def completed_calls(self) -> list[ToolCall]:
        """The streamed calls whose arguments are complete so far, in order (their delta indexes)."""
        return self._stream.completed

    def system_prompt(self) -> str:
        from ._prompt import system_prompt

        return system_prompt(self)

    @abstractmethod
    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        """An xgrammar structural tag forcing calls in this format (see ``_structural``)."""

    # -- format hooks ----------------------------------------------------------------------------

    def _find_region(self, text: str, pos: int) -> tuple[int, bool] | None:
        """The first index >= pos where a region starts (True) or may start once more text comes
        (False: the rest of the text is a prefix of a start), or None."""
        m = self._start_re.search(text, pos, partial=True)
        if m is None or m.start() >= len(text):
            return None
        return m.start(), not m.partial

    @abstractmethod
    def _parse_region(self, text: str, start: int) -> Region:
        """Read the region starting at ``text[start]`` (where ``_find_region`` found a start).

        Must be a pure function of the text, and ``partial`` exactly when more text could still
        make the region valid. Snapshots must only grow as text is appended."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """The model output for these calls, in this format (used for prompts and tests)."""

    # -- helpers -----------------------------------------------------------------------------------

    def _tools_for(self, mode: ToolChoiceMode, function: str | None) -> list[ToolFunction]:
        if mode == "named":
            if function not in self.tool_map:
                raise ValueError(f"tool_choice names {function!r}, which is not among the tools")
            return [self.tool_map[function]]
        if mode not in ("auto", "required"):
            raise ValueError(f"unknown tool choice mode {mode!r}")
        if not self.tools:
            raise ValueError("no tools to call")
        return self.tools


def parameters_of(tool: ToolFunction) -> dict:
    return tool.parameters if isinstance(tool.parameters, dict) and tool.parameters else dict(EMPTY_PARAMETERS)


def grammar_parameters(tool: ToolFunction) -> dict:
    """The parameters schema for a grammar: ``parameters_of`` with local ``$ref``s inlined."""
    from ._schema import inline_refs

    return inline_refs(parameters_of(tool))
