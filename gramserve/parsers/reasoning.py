"""Reasoning parsers: split model output into ``reasoning_content`` and ``content``.

Both parts are stripped of leading/trailing whitespace (``str.strip``); streaming emits exactly
the stripped strings in pieces (whitespace is held back until non-whitespace follows it), and a
partial marker at a chunk end is held back until it is decided. Output that ends inside the
reasoning (no end marker, e.g. truncated) is all reasoning.

* ``deepseek-r1``: the output starts in the reasoning (an opening ``<think>`` is optional) and the
  reasoning ends at ``</think>``.
* ``qwen3``: reasoning only if the output begins with ``<think>``; none when
  ``chat_template_kwargs["enable_thinking"]`` is false.
* ``qwen3-thinking``: the template already opened ``<think>``, so the output starts in the
  reasoning as with deepseek-r1 (none when ``enable_thinking`` is false).
"""

from __future__ import annotations

from abc import ABC
from typing import ClassVar

from ._text import ContentEmitter, partial_suffix


class ReasoningParser(ABC):
    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    forced: ClassVar[bool] = True  # output starts inside the reasoning (start marker optional)
    honors_enable_thinking: ClassVar[bool] = False

    def __init__(self, chat_template_kwargs: dict | None = None):
        kwargs = chat_template_kwargs or {}
        self.thinking = not (self.honors_enable_thinking and kwargs.get("enable_thinking", True) is False)
        self._phase = "start" if self.thinking else "content"
        self._buf = ""
        self._reasoning = ContentEmitter()
        self._content = ContentEmitter()

    @property
    def starts_in_reasoning(self) -> bool:
        return self.thinking and self.forced

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside the reasoning (or may: before the start is decided)."""
        return self._phase == "reasoning" or (self._phase == "start" and self.forced)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        fresh = type(self)({"enable_thinking": self.thinking})
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        r: list[str] = []
        c: list[str] = []
        while True:
            buf = self._buf
            if self._phase == "start":
                head = buf.lstrip()
                if head.startswith(self.start_marker):
                    self._buf = head[len(self.start_marker) :]
                    self._phase = "reasoning"
                    continue
                if not final and (not head or self.start_marker.startswith(head)):
                    break  # undecided yet
                self._phase = "reasoning" if self.forced else "content"
                continue
            if self._phase == "reasoning":
                i = buf.find(self.end_marker)
                if i >= 0:
                    r.append(self._reasoning.push(buf[:i]))
                    self._buf = buf[i + len(self.end_marker) :]
                    self._phase = "content"
                    continue
                keep = 0 if final else partial_suffix(buf, self.end_marker)
                r.append(self._reasoning.push(buf[: len(buf) - keep]))
                self._buf = buf[len(buf) - keep :]
                break
            c.append(self._content.push(buf))
            self._buf = ""
            break
        return "".join(r), "".join(c)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name: ClassVar[str] = "deepseek-r1"


class Qwen3ReasoningParser(ReasoningParser):
    name: ClassVar[str] = "qwen3"
    forced: ClassVar[bool] = False
    honors_enable_thinking: ClassVar[bool] = True


class Qwen3ThinkingReasoningParser(ReasoningParser):
    name: ClassVar[str] = "qwen3-thinking"
    honors_enable_thinking: ClassVar[bool] = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, Qwen3ThinkingReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    key = name.replace("_", "-").lower()
    if key not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[key]
