"""Items of a unique array drawn from a small closed set (``unique_arrays.closed_set``: an enum, booleans, a narrow
integer range) kept to the values not used yet.

No grammar backend enforces ``uniqueItems``. Where items are free text, the loop guard bans the token that would end
an item as a copy and the model writes another character; a closed set leaves no other character (after ``"rea``
only ``d"`` is left, after ``[true, false,`` only copies), so outputs ended as copies and failed the last check again
at every retry. Here the mask of each step inside such an array keeps only the tokens that go on writing a value not
used yet (or end one and the array, or end one and write a comma while another value is left). The service keeps
these tokens only where the grammar allows one of them: the output stays inside the grammar, so it stays valid.

Texts are compared as the shape follower keeps them: the output without whitespace outside strings.
"""

from __future__ import annotations

_WHITESPACE = frozenset(" \n\t\r")
MAX_TOKEN_CHARS = 48  # longest token text looked up as a piece of a value


class ValueTokens:
    """The tokens of a vocabulary by the JSON text they write, read from outside a string (index 0) or inside one
    (index 1), whitespace outside strings left out:

    - ``pieces``: tokens that stay within one scalar value (``"Mo``, ``n"``, ``tru``, ``12``; whitespace only: ``""``);
    - ``enders``: tokens that reach a ``,`` or ``]`` outside strings, or whitespace after a number or literal, by the
      text before it: (token, a comma, and the text after the comma up to where it could still be the start of a
      value, or None if it is more).
    Tokens with ``[ { } :`` outside strings, or that end inside an escape, are in neither."""

    __slots__ = ("pieces", "enders")

    def __init__(self, texts: list[str]):
        self.pieces: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        self.enders: tuple[dict[str, list[tuple[int, bool, str | None]]], ...] = ({}, {})
        for token, text in enumerate(texts):
            if not text:
                continue
            for ctx in (0, 1):
                read = _read(text, bool(ctx))
                if read is None:
                    continue
                head, end, tail = read
                if end is None:
                    self.pieces[ctx].setdefault(head, []).append(token)
                else:
                    self.enders[ctx].setdefault(head, []).append((token, end == ",", tail))


def _read(text: str, in_string: bool) -> tuple[str, str | None, str | None] | None:
    """(the text written before any ``,`` / ``]`` outside strings, that character or None, what follows a comma as the
    next value's start or None); None for a token this module leaves alone."""
    out: list[str] = []
    escaped = False
    for i, c in enumerate(text):
        if in_string:
            out.append(c)
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c in _WHITESPACE:
            if out and out[-1] != '"':
                return "".join(out), " ", None  # it ends the number or literal before it (`1 `)
            continue
        elif c == '"':
            in_string = True
            out.append(c)
        elif c in ",]":
            tail = _read(text[i + 1 :], False) if c == "," else None
            return "".join(out), c, tail[0] if tail is not None and tail[1] is None else None
        elif c in "[{}:":
            return None
        else:
            out.append(c)
    if escaped:
        return None
    return "".join(out), None, None


def item_choices(
    tokens: ValueTokens, values: frozenset[str], used: set[str], so_far: str, in_string: bool, done: bool
) -> list[int]:
    """The tokens that keep the current item of a unique array to the `values` not `used` yet.

    `so_far`: the item's text so far (no whitespace outside strings); `done`: it is a complete string (already in
    `used`). Empty where the item is not on its way to any value left (the mask is then not narrowed)."""
    ctx = 1 if in_string else 0
    left = [v for v in values if v not in used]
    out: list[int] = []
    if done:
        pairs = [(so_far, "")]
    else:
        pairs = [(v, v[len(so_far) :]) for v in left if v.startswith(so_far)]
        if not pairs:
            return []  # on its way to no value left (the set may be narrower than the grammar): the grammar decides
        if not so_far and not in_string:  # before the item: whitespace, or the array's end (the grammar decides)
            out += tokens.pieces[0].get("", ())
            out += [token for token, comma, _ in tokens.enders[0].get("", ()) if not comma]
    pieces, enders = tokens.pieces[ctx], tokens.enders[ctx]
    for value, rest in pairs:
        for i in range(1, min(len(rest), MAX_TOKEN_CHARS) + 1):
            out += pieces.get(rest[:i], ())
        if not rest and not in_string:
            out += pieces.get("", ())  # whitespace after a complete value
        for token, comma, tail in enders.get(rest, ()):
            # the value ends here: then the array, or a comma if another value is left for the next item
            if not comma or (tail is not None and any(w != value and w.startswith(tail) for w in left)):
                out.append(token)
    return out
