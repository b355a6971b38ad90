"""Pythonic format: ``[get_weather(city="Paris"), f()]`` (keyword arguments with Python literal
values), read with ``ast``. Text may come before the list; a region starts at ``[name(``."""

from __future__ import annotations

import ast
import json
import re
from typing import ClassVar

import regex

from . import _structural as st
from ._pygrammar import PyGrammar, lit
from .base import CallSnapshot, Region, ToolCallParser, ToolChoiceMode, grammar_parameters

# Strings (possibly unterminated at the end of the text), brackets and commas.
_TOKENS = re.compile(
    r"""(?P<s>'''[^\\']*(?:(?:\\.|'(?!''))[^\\']*)*(?:'''|\\?\Z)"""
    r"""|\"\"\"[^\\"]*(?:(?:\\.|"(?!""))[^\\"]*)*(?:\"\"\"|\\?\Z)"""
    r"""|'[^'\\\n]*(?:\\.[^'\\\n]*)*(?:'|\\?\Z)|"[^"\\\n]*(?:\\.[^"\\\n]*)*(?:"|\\?\Z))"""
    r"""|(?P<b>[\[\](){}])|(?P<c>,)""",
    re.S,
)
# Tool names may contain "-" (OpenAI allows [a-zA-Z0-9_-]); the name is cut off before ``ast``.
_CALL_HEAD = regex.compile(r"\s*(?P<name>[A-Za-z_][\w.\-]*)\s*\(")
_CLOSE = {")": "(", "]": "[", "}": "{"}


def _string_closed(tok: str) -> bool:
    for q in ("'''", '"""'):
        if tok.startswith(q):
            return len(tok) >= 6 and tok.endswith(q) and not _escaped(tok, len(tok) - 3)
    return len(tok) >= 2 and tok[-1] == tok[0] and not _escaped(tok, len(tok) - 1)


def _escaped(tok: str, i: int) -> bool:
    n = 0
    while i - 1 - n >= 0 and tok[i - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


def read_call(source: str) -> CallSnapshot | None:
    """``name(k=literal, ...)`` -> a complete snapshot, or None if it is not such a call."""
    head = _CALL_HEAD.match(source)
    if head is None:
        return None
    name = head.group("name")
    try:
        node = ast.parse("f(" + source[head.end() :].strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return CallSnapshot(name, text, True)


class PythonicToolCallParser(ToolCallParser):
    name: ClassVar[str] = "pythonic"
    start_pattern: ClassVar[str] = r"\[\s*[A-Za-z_][\w.\-]*\s*\("

    def _parse_region(self, text: str, start: int) -> Region:
        calls: list[CallSnapshot] = []
        stack: list[str] = []
        seg = start + 1  # start of the current call's source
        for m in _TOKENS.finditer(text, start + 1):
            if m.group("s") is not None:
                if not _string_closed(m.group("s")):
                    break
                continue
            tok = m.group()
            if tok in "([{":
                stack.append(tok)
                continue
            if tok == ",":
                if stack:
                    continue
            elif stack:
                if stack.pop() != _CLOSE[tok]:
                    return Region("invalid", calls, m.start())
                continue
            elif tok != "]":
                return Region("invalid", calls, m.start())
            # A top-level "," or "]" ends the current call.
            snap = read_call(text[seg : m.start()])
            if snap is None:
                return Region("invalid", calls, seg)
            calls.append(snap)
            if tok == "]":
                return Region("done", calls, m.end())
            seg = m.end()
        head = _CALL_HEAD.match(text, seg, partial=True)
        if head is None:
            return Region("invalid", calls, seg)
        if not head.partial:
            calls.append(CallSnapshot(head.group("name")))
        return Region("partial", calls, seg)

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        def call(n: str, a: dict) -> str:
            return n + "(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"

    def structural_tag(self, mode: ToolChoiceMode, parallel: bool, function: str | None = None) -> dict:
        tools = self._tools_for(mode, function)
        g = PyGrammar()
        call = g.rule(" | ".join(f'{lit(t.name + "(")} ws {g.kwargs(grammar_parameters(t))} ws ")"' for t in tools))
        body = f'ws {call} (ws "," ws {call})* ws' if parallel and mode != "named" else f"ws {call} ws"
        the_list = st.tag("[", {"type": "grammar", "grammar": g.text(body)}, "]")
        if mode == "auto":
            # Trigger "[": free text has no "[" at all, so that no call to an unknown tool gets by.
            return st.wrap(
                {
                    "type": "triggered_tags",
                    "triggers": ["["],
                    "tags": [the_list],
                    "at_least_one": False,
                    "stop_after_first": True,
                }
            )
        return st.wrap(the_list)
