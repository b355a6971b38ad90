"""Follows the shape of a JSON output token by token, for the loop guard: is it inside a string, and which arrays
and objects are open around it; and notices two ways a small model stalls in them.

- A **stalled string**: the open string's last ``STALL_SPAN`` tokens hold at most ``STALL_DISTINCT`` distinct ones
  (``"FleetAppServerClientFleetFleetAppServer..."``, ``"nj-nj-jnjn-nj-jnjj..."``). Natural text has about 40
  distinct tokens in 48.
- A **stalled container**: an array whose latest items (strings, objects or arrays, compared without the whitespace
  between tokens) repeat with a period of at most ``ITEM_PERIOD`` items, over three periods of at least
  ``ITEM_CHARS`` characters or over ``ITEM_SPAN`` items: ``{"Key": "1234567890", "Value": "1234567890"}, {...}``
  again and again, with the newlines between them changing, which is why the token loops miss them. Or an object
  in which a key came twice (``"v1beta1": ..., "v1beta1":``). Numbers and literals are never counted:
  ``[0, 0, 0, 0, 0, 0]`` is data. While a key is written, the tokens that would end it as a key its object already
  has are banned (``duplicate_keys``), so a key comes twice only where the grammar allows nothing else.

The guard then narrows the next mask to the tokens that close the string, or the container (where the grammar allows
one), so every output stays inside its grammar. A model writes an item's end and the comma after it as one token
(``},``, ``",\n``) more often than not, which would leave no point between the two to close at: while an item that
can be the last is written (its container is stalled, or one more copy would stall it: "primed"), those tokens are
dropped from the mask.

In an array the schema marks ``uniqueItems`` (the value of a member whose key is one of ``unique_keys``, or the whole
output), which no grammar backend enforces (the last check does, by sampling again), it also keeps an item from
ending as a copy of an earlier one: while the item's last string is written and the item so far equals the start of
an earlier item, the tokens that would end that string as the earlier item's did (the rest of the item being only its
closing brackets) are banned (``duplicate_endings``), and the model writes another character instead: two copies of
``{"Key": "1234567890", "Value": "1234567890"}`` would fail the check. A model that copies items keeps on writing
near-copies, so the array is stalled after that item. Where such an array's items come from a small closed set (an
enum, booleans, a narrow integer range), a copy cannot be altered, so each item is kept to the values not used yet
instead (``unique_choices``, unique_choices.py).
"""

from __future__ import annotations

import re
from collections import deque

import numpy as np

from gramserve.grammar.unique_choices import ValueTokens, item_choices
from gramserve.sampling.bitmask import bitmask_words

STALL_SPAN = 48  # a string's latest tokens looked at ...
STALL_DISTINCT = 16  # ... and at most this many distinct ones among them is a stalled string
ITEM_PERIOD = 3  # longest period (in items) of a repeating array
ITEM_SPAN = 6  # items an array repeats over (and at least 3 periods) before it is stalled ...
ITEM_CHARS = 96  # ... or fewer items, at least 3 periods, that hold this many characters (3 copies of a long item)
_TRIM = 4096  # text no open container needs any more is dropped once it is this long
UNIQUE_ITEMS = 64  # a unique array's items remembered (each at most UNIQUE_CHARS long) ...
UNIQUE_CHARS = 1024  # ... for duplicate_endings

# byte-level BPE writes a space, newline, tab and carriage return as these letters; SentencePiece writes a space as ▁
_READABLE = str.maketrans({"Ġ": " ", "Ċ": "\n", "ĉ": "\t", "č": "\r", "▁": " "})
_WHITESPACE = frozenset(" \n\t\r")
_END_AND_COMMA = re.compile(r'["}\]]\s*,')  # a token that ends a value and writes the comma after it


class JsonTokens:
    """A vocabulary as the follower reads it: each token's text, and bitmasks of the tokens that can close a string
    (an unescaped quote) and of those that close an array or object (``]`` or ``}`` after any whitespace)."""

    __slots__ = (
        "texts", "vocab_size", "string_closers", "container_closers", "end_and_comma", "_by_string_end", "_values",
    )  # fmt: skip

    def __init__(self, texts: list[str], vocab_size: int):
        self.texts = texts  # token id -> its text ("" for ids the tokenizer does not name)
        self.vocab_size = vocab_size
        # The tokens that close a string, by the text before their quote (20 ms for 49k tokens): keys and unique
        # arrays ask for them in the middle of a step.
        self._by_string_end: dict[str, list[int]] = {}
        for token, t in enumerate(texts):
            if (end := _closing_quote(t)) >= 0:
                self._by_string_end.setdefault(t[:end], []).append(token)
        self._values: ValueTokens | None = None
        self.string_closers = _bitmask((i for i, t in enumerate(texts) if '"' in t and _closes(t)), vocab_size)
        self.container_closers = _bitmask((i for i, t in enumerate(texts) if t.lstrip()[:1] in ("]", "}")), vocab_size)
        self.end_and_comma = _bitmask((i for i, t in enumerate(texts) if _END_AND_COMMA.search(t)), vocab_size)

    def ending_string_with(self, text: str) -> list[int]:
        """The tokens that, read inside a string, write exactly `text` and then its closing quote (and maybe more)."""
        return self._by_string_end.get(text, [])

    @property
    def values(self) -> ValueTokens:
        """The tokens by the JSON value text they write (unique_choices.py), built on first use: few schemas have
        unique arrays of closed sets."""
        if self._values is None:
            self._values = ValueTokens(self.texts)
        return self._values

    def bitmask(self, tokens) -> np.ndarray:
        """A bitmask (uint32 words) of these token ids."""
        return _bitmask(tokens, self.vocab_size)

    @classmethod
    def of(cls, tokenizer, vocab_size: int) -> "JsonTokens":
        texts = [""] * vocab_size
        for text, token in tokenizer.get_vocab().items():
            if token < vocab_size:
                texts[token] = text.translate(_READABLE)
        return cls(texts, vocab_size)


def _bitmask(tokens, vocab_size: int) -> np.ndarray:
    words = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
    for token in tokens:
        words[token >> 5] |= np.uint32(1 << (token & 31))
    return words


def _closes(text: str) -> bool:
    """Does a token with this text close a string it starts inside (no escape pending)?"""
    return _closing_quote(text) >= 0


def _closing_quote(text: str) -> int:
    """Where the quote is that closes a string a token with this text starts inside (no escape pending); -1: none."""
    escaped = False
    for i, c in enumerate(text):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return i
    return -1


class _Open:
    """One open array or object: where its current item (or key) began in the follower's text, and what came
    before in it."""

    __slots__ = (
        "array", "start", "done", "items", "keys", "key_start", "expect_key", "stalled", "primed", "last_key",
        "uniques", "copying", "values", "used",
    )  # fmt: skip

    def __init__(self, array: bool, start: int, unique: bool = False, values: frozenset[str] | None = None):
        self.array = array
        self.start = start  # arrays: where the current item's text begins (a JsonShape position)
        self.done = False  # arrays: the current item (a string, array or object) is complete
        self.items: list[tuple[int, int]] = []  # arrays: the latest items' (hash, length), at most 3 * ITEM_PERIOD
        self.keys: dict[int, str] = {}  # objects: the keys so far (their text with the quotes), by hash
        self.key_start = -1  # objects: where the key being read begins (-1: not in a key)
        self.expect_key = not array
        self.stalled = False
        self.primed = False  # arrays: one more repeat of an earlier item would stall it
        self.last_key = 0  # objects: the hash of the latest key (with its quotes)
        self.uniques: list[str] | None = [] if unique else None  # unique arrays: the items so far (UNIQUE_ITEMS)
        self.copying = False  # unique arrays: the current item set out to copy an earlier one (duplicate_endings)
        self.values = values  # unique arrays of a closed set: the values (JSON texts) items are drawn from
        self.used: set[str] = set()  # ... and those items took so far


class JsonShape:
    """The shape of one JSON output so far: feed it each accepted token. Its text (``chars``) is the output without
    the whitespace outside strings, from position ``base`` on (what no open container needs is dropped)."""

    __slots__ = (
        "_tokens", "_texts", "chars", "base", "_open", "in_string", "_escaped", "_window", "_distinct", "_unique_keys",
        "_unique_root", "_domains", "_root_domain",
    )  # fmt: skip

    def __init__(
        self,
        tokens: JsonTokens,
        unique_keys: frozenset[str] = frozenset(),
        unique_root: bool = False,
        domains: tuple[tuple[str, frozenset[str]], ...] = (),
        root_domain: frozenset[str] | None = None,
    ):
        """`unique_keys`: the names of members whose value is an array the schema marks uniqueItems; `unique_root`: the
        output itself is one; `domains` and `root_domain`: the closed sets of those arrays' items, where known."""
        self._tokens = tokens
        self._texts = tokens.texts
        self._unique_keys = frozenset(hash(f'"{k}"') for k in unique_keys)  # as _string_closed hashes keys
        self._unique_root = unique_root
        self._domains = {hash(f'"{k}"'): values for k, values in domains}
        self._root_domain = root_domain
        self.chars: list[str] = []
        self.base = 0  # the position of chars[0] in the whole text
        self._open: list[_Open] = []
        self.in_string = False
        self._escaped = False
        self._window: deque[int] = deque()  # the open string's latest tokens (at most STALL_SPAN)
        self._distinct: dict[int, int] = {}  # token -> how often it is in the window

    def accept(self, token: int) -> None:
        text = self._texts[token] if 0 <= token < len(self._texts) else ""
        if self.in_string and not self._escaped and '"' not in text and "\\" not in text:
            self.chars.extend(text)  # the common case inside a string: nothing changes but the text
        else:
            for c in text:
                self._read(c)
        if self.in_string:
            self._into_window(token)
        if len(self.chars) > 2 * _TRIM:
            self._trim()

    def string_stalled(self) -> bool:
        return self.in_string and len(self._window) == STALL_SPAN and len(self._distinct) <= STALL_DISTINCT

    def _into_window(self, token: int) -> None:
        window, distinct = self._window, self._distinct
        if len(window) == STALL_SPAN:
            old = window.popleft()
            if distinct[old] == 1:
                del distinct[old]
            else:
                distinct[old] -= 1
        window.append(token)
        distinct[token] = distinct.get(token, 0) + 1

    def _clear_window(self) -> None:
        self._window.clear()
        self._distinct.clear()

    def container_stalled(self) -> bool:
        """Is the innermost open container stalled, with the output outside any string in it?"""
        return not self.in_string and bool(self._open) and self._open[-1].stalled

    def item_may_be_last(self) -> bool:
        """Is the output writing an item (or a member's value) of a stalled container, or an item that would stall
        its array if it repeats an earlier one: in a string directly in it, or in an array or object directly in it?"""
        opened = self._open
        if self.in_string and opened and (opened[-1].stalled or opened[-1].primed):
            return True
        return len(opened) > 1 and (opened[-2].stalled or opened[-2].primed)

    def duplicate_endings(self) -> list[int]:
        """Inside a string of an item of a unique array (the innermost open array): the tokens that would end the
        string so that the item, whose rest is then only closing brackets, equals an earlier item. Empty elsewhere."""
        if not self.in_string or self._escaped:
            return []
        opened = self._open
        depth = len(opened) - 1
        while depth >= 0 and not opened[depth].array:
            depth -= 1
        if depth < 0 or not opened[depth].uniques or opened[depth].values is not None:
            return []  # a closed set's items are kept from copies by unique_choices
        array = opened[depth]
        so_far = "".join(self.chars[array.start - self.base :])
        closers = len(opened) - 1 - depth  # objects and arrays open inside the item
        out: list[int] = []
        for earlier in array.uniques:
            if not earlier.startswith(so_far):
                continue
            rest = earlier[len(so_far) :]
            end = _closing_quote(rest)
            if end >= 0 and len(rest) - end - 1 == closers and all(c in "]}" for c in rest[end + 1 :]):
                out += self._tokens.ending_string_with(rest[:end])
        if out:
            # The model is copying items: the altered copy it now writes may be the last (stalled after it).
            array.copying = array.primed = True
        return out

    def duplicate_keys(self) -> list[int]:
        """Inside a key of an object: the tokens that would end it as a key the object already has (after
        ``"type": 1, "ty`` the tokens ``pe"``, ``pe":`` ...). Only open objects (additionalProperties,
        patternProperties) let a model repeat a key; the parsed value would keep one of the two. Empty elsewhere."""
        if not self.in_string or self._escaped or not self._open:
            return []
        top = self._open[-1]
        if top.array or top.key_start < 0 or not top.keys:
            return []
        so_far = "".join(self.chars[top.key_start - self.base :])  # from the opening quote
        out: list[int] = []
        for key in top.keys.values():
            if len(key) > len(so_far) and key.startswith(so_far):
                out += self._tokens.ending_string_with(key[len(so_far) : -1])
        return out

    def unique_choices(self) -> list[int]:
        """In an item of a unique array of a closed set (the innermost open container): the tokens that keep it to
        the values not used yet (unique_choices.py). Empty elsewhere, or where the item is on its way to none."""
        opened = self._open
        if self._escaped or not opened or opened[-1].values is None:
            return []
        array = opened[-1]
        so_far = "".join(self.chars[array.start - self.base :])
        done = array.done and not self.in_string
        return item_choices(self._tokens.values, array.values, array.used, so_far, self.in_string, done)

    def _read(self, c: str) -> None:
        chars = self.chars
        if self.in_string:
            chars.append(c)
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self.in_string = False
                self._clear_window()
                self._string_closed()
            return
        if c in _WHITESPACE:
            return
        top = self._open[-1] if self._open else None
        if c == '"':
            if top is not None and top.expect_key:
                top.key_start = self.base + len(chars)
            self.in_string = True
            self._clear_window()
        elif c in "[{":
            unique = c == "[" and (top.last_key in self._unique_keys if top is not None else self._unique_root)
            values = None
            if unique:
                values = self._domains.get(top.last_key) if top is not None else self._root_domain
            self._open.append(_Open(c == "[", self.base + len(chars) + 1, unique, values))
        elif c in "]}":
            if top is not None:
                self._open.pop()
                if self._open and self._open[-1].array:
                    chars.append(c)
                    self._item_done(self._open[-1])
                    return
        elif c == "," and top is not None:
            if top.array:
                if not top.done:
                    self._item_done(top)
                top.start = self.base + len(chars) + 1
                top.done = False
            else:
                top.expect_key = True
        chars.append(c)

    def _string_closed(self) -> None:
        top = self._open[-1] if self._open else None
        if top is None:
            return
        if top.array:
            self._item_done(top)
            return
        if top.key_start < 0:
            return
        text = "".join(self.chars[top.key_start - self.base :])
        key = hash(text)
        if key in top.keys:
            top.stalled = True  # a key twice in one object: no schema wants that
        top.keys[key] = text
        top.last_key = key
        top.key_start = -1
        top.expect_key = False

    def _item_done(self, top: _Open) -> None:
        """An item of `top` is complete: a string, array or object at its closing character, others at the comma."""
        top.done = True
        item = "".join(self.chars[top.start - self.base :])
        if top.values is not None:
            top.used.add(item)
        items = top.items
        if not item or item[0] not in '"[{':
            items.clear()  # numbers and literals repeat in real data
            top.stalled = top.primed = False
            return
        if top.uniques is not None and len(top.uniques) < UNIQUE_ITEMS and len(item) <= UNIQUE_CHARS:
            top.uniques.append(item)
        items.append((hash(item), len(item)))
        if len(items) > 3 * ITEM_PERIOD:
            del items[0]
        top.stalled = _repeating(items) or top.copying
        top.copying = False
        # would the next item stall it, were it a copy of the one p back?
        top.primed = not top.stalled and any(
            _repeating(items + [items[-p]]) for p in range(1, min(ITEM_PERIOD, len(items)) + 1)
        )

    def _trim(self) -> None:
        """Drop the text before the earliest position an open container still needs (an array's current item, an
        object's key), once that is more than _TRIM characters (`accept` asks once the text is twice that)."""
        end = self.base + len(self.chars)
        need = (
            min((o.start if o.array else o.key_start if o.key_start >= 0 else end) for o in self._open)
            if self._open
            else end
        )
        if need - self.base > _TRIM:
            del self.chars[: need - self.base]
            self.base = need


def _repeating(items: list[tuple[int, int]]) -> bool:
    """Do the latest items repeat with a period of at most ITEM_PERIOD, over three periods of at least ITEM_CHARS
    characters, or over ITEM_SPAN items?"""
    n = len(items)
    for p in range(1, ITEM_PERIOD + 1):
        if n < 3 * p:
            break
        if items[-1] != items[-1 - p] or not all(items[-i] == items[-i - p] for i in range(2, 2 * p + 1)):
            continue  # not three periods
        if sum(length for _, length in items[-3 * p :]) >= ITEM_CHARS:
            return True
        span = max(ITEM_SPAN, 3 * p)
        if n >= span and all(items[-i] == items[-i - p] for i in range(2 * p + 1, span - p + 1)):
            return True
    return False
