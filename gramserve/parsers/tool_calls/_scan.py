"""Reading helpers shared by the formats: JSON containers, ``header {args} tail`` calls, and
sections of several calls (``open call (sep call)* close``).

A *call reader* is ``f(text, pos) -> (status, snapshot | None, end)`` with the status of
:class:`~.base.Region`; ``end`` is just past the call when done, where it broke when invalid.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import regex

from .base import CallSnapshot, Region

CallReader = Callable[[str, int], "tuple[str, CallSnapshot | None, int]"]

_PAIRS = {"}": "{", "]": "["}

# A JSON object (recursive ``regex`` pattern); with partial=True a match means "a prefix of one".
_JSON_OBJECT = regex.compile(
    r"""(?(DEFINE)(?<ws>[ \t\n\r]*)(?<str>"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*")"""
    r"""(?<num>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"""
    r"""(?<val>(?&str)|(?&num)|true|false|null|(?&obj)|(?&arr))"""
    r"""(?<obj>\{(?&ws)(?:(?&str)(?&ws):(?&ws)(?&val)(?&ws)(?:,(?&ws)(?&str)(?&ws):(?&ws)(?&val)(?&ws))*)?\})"""
    r"""(?<arr>\[(?&ws)(?:(?&val)(?&ws)(?:,(?&ws)(?&val)(?&ws))*)?\]))(?&obj)"""
)
# Incomplete arguments longer than this are not checked as a JSON prefix (the check is linear in
# the length, and repeated on every chunk); complete ones always are (json.loads).
PREFIX_CHECK_LIMIT = 1024

# A JSON call object up to its arguments value: {"name": "f", "arguments": (also "parameters",
# and an optional leading "type": "function").
JSON_CALL_HEAD = (
    r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*'
    r'"(?:arguments|parameters)"\s*:\s*'
)


def json_container_end(text: str, start: int) -> int | None:
    """Index just past the JSON object/array opening at ``text[start]``; None if the text ends
    first; -1 if the brackets do not match.

    Streaming re-reads a growing text on every chunk, so the scan resumes from a cached state when
    the text extends the one scanned before (checked with ``startswith``)."""
    key = (start, text[start : start + 16])
    cached = _scan_cache.get(key)
    if cached is not None and text.startswith(cached[0]):
        pos, stack, in_string = len(cached[0]), list(cached[1]), cached[2]
    else:
        pos, stack, in_string = start, [], False
    n = len(text)
    while True:
        if in_string:
            pos = _STRING_REST.match(text, pos).end()
            if pos >= n or text[pos] == "\\":  # the string (or an escape) is cut off
                break
            pos += 1  # the closing quote
            in_string = False
        m = _STRUCTURE.search(text, pos)
        if m is None:
            pos = n
            break
        c = m.group()
        pos = m.end()
        if c == '"':
            in_string = True
        elif c in "{[":
            stack.append(c)
        elif not stack or stack.pop() != _PAIRS[c]:
            return -1
        elif not stack:
            return pos
    if pos - start >= 256:  # short ones are cheap to rescan
        if len(_scan_cache) >= 256:
            _scan_cache.clear()
        _scan_cache[key] = (text[:pos], tuple(stack), in_string)
    return None


_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_STRUCTURE = re.compile(r'["{}\[\]]')
_scan_cache: dict[tuple[int, str], tuple[str, tuple[str, ...], bool]] = {}


def json_object_text(s: str) -> bool:
    """Whether s is exactly one JSON object (strict JSON: no NaN/Infinity)."""
    try:
        return isinstance(json.loads(s, parse_constant=_no_constant), dict)
    except ValueError:
        return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def decode_json_string(body: str) -> str | None:
    try:
        v = json.loads('"' + body + '"')
    except ValueError:
        return None
    return v if isinstance(v, str) else None


def json_args_call(head: str, tail: str | None, name_of: Callable[[regex.Match], str | None]) -> CallReader:
    """A call ``HEAD {arguments} TAIL`` (regexes); ``name_of`` extracts the name from the head."""
    head_re = regex.compile(head, regex.S)
    tail_re = regex.compile(tail, regex.S) if tail else None

    def read(text: str, pos: int):
        m = head_re.match(text, pos, partial=True)
        if m is None:
            return "invalid", None, pos
        if m.partial:
            return "partial", None, pos
        name = name_of(m)
        if not name:
            return "invalid", None, pos
        a = m.end()
        if a >= len(text):
            return "partial", CallSnapshot(name), a
        if text[a] != "{":
            return "invalid", CallSnapshot(name), a
        e = json_container_end(text, a)
        if e is None:
            if len(text) - a <= PREFIX_CHECK_LIMIT and _JSON_OBJECT.match(text, a, partial=True) is None:
                return "invalid", CallSnapshot(name), a  # not the start of a JSON object
            return "partial", CallSnapshot(name, text[a:]), len(text)
        if e < 0 or not json_object_text(text[a:e]):
            return "invalid", CallSnapshot(name, text[a:e] if e > 0 else text[a:]), a
        snap = CallSnapshot(name, text[a:e], True)
        if tail_re is None:
            return "done", snap, e
        t = tail_re.match(text, e, partial=True)
        if t is None:
            return "invalid", snap, e
        if t.partial:
            return "partial", snap, e
        return "done", snap, t.end()

    return read


def json_name(m: regex.Match) -> str | None:
    return decode_json_string(m.group("name"))


def plain_name(m: regex.Match) -> str | None:
    return m.group("name")


def read_section(
    text: str,
    pos: int,
    call: CallReader,
    *,
    open: str | None = None,
    sep: str | None = None,
    close: str | None = None,
) -> Region:
    """``OPEN call (SEP call)* CLOSE`` (regexes; SEP None: calls follow each other directly;
    CLOSE None: the section ends after the last call)."""
    calls: list[CallSnapshot] = []
    if open is not None:
        mo = _compile(open).match(text, pos, partial=True)
        if mo is None:
            return Region("invalid", calls, pos)
        if mo.partial:
            return Region("partial", calls, pos)
        pos = mo.end()
    close_re = _compile(close) if close else None
    sep_re = _compile(sep) if sep else None
    while True:
        status, snap, end = call(text, pos)
        if snap is not None:
            calls.append(snap)
        if status != "done":
            return Region(status, calls, end)
        pos = end
        pending = False
        if close_re is not None:
            mc = close_re.match(text, pos, partial=True)
            if mc is not None and not mc.partial:
                return Region("done", calls, mc.end())
            pending = mc is not None
        nxt = pos
        if sep_re is not None:
            ms = sep_re.match(text, pos, partial=True)
            if ms is None or ms.partial:
                pending = pending or ms is not None
                nxt = -1
            else:
                nxt = ms.end()
        if nxt >= 0 and call(text, nxt)[0] != "invalid":
            pos = nxt
            continue
        if pending:
            return Region("partial", calls, pos)
        return Region("done", calls, pos) if close_re is None else Region("invalid", calls, pos)


_cache: dict[str, regex.Pattern] = {}


def _compile(pattern: str) -> regex.Pattern:
    p = _cache.get(pattern)
    if p is None:
        p = _cache[pattern] = regex.compile(pattern, regex.S)
    return p
