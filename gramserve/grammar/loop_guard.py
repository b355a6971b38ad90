"""The loop guard: keeps a constrained JSON output from repeating one span of tokens until max_tokens.

Small models, greedy ones most, fall into exact loops inside JSON values: ``"easy_easy_easy_..."``, a run of
``0``s, ``"controller": {"controller": {...`` (docs/benchmarks.md, issue 19 run 4: two thirds of the outputs cut
at max_tokens ended inside such a string). A grammar cannot forbid them: the schema allows them.

The guard watches each constrained request's accepted tokens. When the last tokens are periodic (period ``p`` up
to ``MAX_PERIOD`` tokens) over a span of at least ``MIN_SPAN`` tokens and ``MIN_REPEATS`` periods, it bans the
token that would continue the loop from the next mask, and remembers the ban: later, whenever the same ``p`` (at
least ``MIN_CONTEXT``) tokens come again, that token is banned again, so the loop cannot start over. Only a token
the grammar allows is ever removed, and never the last one allowed: every output stays inside the grammar, so it
stays valid. Its cost is a few comparisons per accepted token.

It also ends runs of digits: past ``MAX_DIGIT_RUN`` digits in a row (inside a string or a number), no digit token is
allowed next. Greedy small models wander in digit strings that never repeat exactly (``"1212211122131111..."``:
about a fifth of the outputs still cut at max_tokens in issue 19's CPU sample); no real value needs that many
digits in a row (a 64-bit integer has 20), and where the grammar allows nothing but digits, it still decides.

And with the shape of the output (``grammar/json_shape.py``) it ends strings that stall (a near-loop of a few
distinct tokens), arrays whose items repeat, and objects that repeat a key: the next mask keeps only the tokens
that close them, where the grammar allows one.
"""

from __future__ import annotations

import numpy as np

from gramserve.grammar.json_shape import JsonShape, JsonTokens
from gramserve.grammar.unique_arrays import UniqueArrays

MAX_PERIOD = 32  # longest loop (in tokens) recognised
MIN_SPAN = 16  # a loop is this many tokens of one repeated period ...
MIN_REPEATS = 3  # ... and at least this many whole periods
MIN_CONTEXT = 4  # a remembered ban matches at least this many preceding tokens
MAX_DIGIT_RUN = 32  # digits in a row past which the next token may not be a digit
MAX_COUNTED_DIGITS = 18  # longer numbers are not read as a counter (int() of thousands of digits is slow, or refused)


# run + p >= these (index p - 1): the latest tokens repeat period p over MIN_SPAN tokens and MIN_REPEATS periods
_RUN_NEEDED = [max(MIN_SPAN, MIN_REPEATS * p) - p for p in range(1, MAX_PERIOD + 1)]
_NOTHING: frozenset[int] = frozenset()
_KEEP = max(MIN_REPEATS * MAX_PERIOD, MIN_CONTEXT)  # items kept: three periods of the longest loop


class DigitTokens:
    """The tokens of a vocabulary that are digits only (and their digits), and those that hold a letter."""

    __slots__ = ("texts", "ids", "wordy")

    def __init__(self, texts: dict[int, str], wordy: frozenset[int] = frozenset()):
        self.texts = texts  # token id -> its digits (digit-only tokens)
        self.ids = frozenset(texts)
        self.wordy = wordy  # tokens with a letter: a counting loop has one in its period

    @classmethod
    def of(cls, tokenizer) -> "DigitTokens":
        # Digits are themselves in a byte-level BPE vocabulary and in SentencePiece's (a leading-space piece is not
        # digit-only, and ends a run as the space does).
        vocab = tokenizer.get_vocab()
        texts = {i: t for t, i in vocab.items() if t.isascii() and t.isdigit()}
        # ASCII letters only: a byte-level vocabulary writes a leading space as the letter "Ġ"
        return cls(texts, frozenset(i for t, i in vocab.items() if any(c.isascii() and c.isalpha() for c in t)))


DIGITS = -1  # one run of digit tokens, as one item of a guard's counting sequence


class _Periods:
    """The latest items of a sequence, which periods they repeat, and the bans remembered after loops in them."""

    __slots__ = ("items", "values", "runs", "bans", "lengths")

    def __init__(self) -> None:
        self.items: list[int] = []  # oldest first (at most 2 * _KEEP)
        self.values: list[str] = []  # beside items: a DIGITS item's digits ("" for others)
        # period p -> how many latest items equal the item p before them (nonzero only, shortest period first)
        self.runs: dict[int, int] = {}
        self.bans: dict[tuple[int, ...], set[int]] = {}  # preceding items -> tokens banned after them
        self.lengths: set[int] = set()  # the context lengths in bans

    def push(self, item: int, value: str = "") -> None:
        items, runs = self.items, self.runs
        recent = items[: -MAX_PERIOD - 1 : -1]  # newest first: recent[p - 1] is the item p back
        grown: dict[int, int] = {}
        i = -1
        for _ in range(recent.count(item)):  # usually none or a few places, found by scans in C
            i = recent.index(item, i + 1)
            grown[i + 1] = runs.get(i + 1, 0) + 1
        self.runs = grown
        items.append(item)
        self.values.append(value)
        if len(items) > 2 * _KEEP:
            del items[:-_KEEP]
            del self.values[:-_KEEP]

    def period(self) -> int:
        """The shortest period the latest items repeat over MIN_SPAN items and MIN_REPEATS periods (0: none)."""
        for p, run in self.runs.items():
            if run >= _RUN_NEEDED[p - 1]:
                return p
        return 0

    def remember(self, p: int, token: int) -> None:
        """`token` continued a loop of period p here: ban it whenever these items come again."""
        k = max(p, MIN_CONTEXT)
        if k <= len(self.items):
            self.bans.setdefault(tuple(self.items[-k:]), set()).add(token)
            self.lengths.add(k)

    def remembered(self) -> set[int]:
        out: set[int] = set()
        for k in self.lengths:
            out |= self.bans.get(tuple(self.items[-k:]), _NOTHING)
        return out


class LoopGuard:
    """The loop state of one constrained request: feed it each accepted token, ask what to ban next.

    Two sequences are watched: the tokens (exact loops), and, with `digits`, the tokens with each run of digits as
    one item (counting loops: ``"map49": {"map50": {...``, where only numbers change from period to period, every one
    of them upwards, and the period holds a word). With `json_tokens`, the output's JSON shape is followed too
    (json_shape.py: stalled strings, repeating array items, repeated keys)."""

    __slots__ = ("_tokens", "_counting", "_digits", "_digit_run", "_json", "_shape")

    def __init__(
        self,
        digits: DigitTokens | None = None,
        json_tokens: JsonTokens | None = None,
        unique: UniqueArrays | None = None,
    ) -> None:
        self._tokens = _Periods()
        self._counting = _Periods() if digits is not None else None
        self._digits = digits  # None: no counting loops, digit runs not bounded
        self._digit_run = 0  # digits in a row at the end of the output
        self._json = json_tokens
        self._shape = None  # None: the shape is not followed
        if json_tokens is not None:
            unique = unique or UniqueArrays()
            self._shape = JsonShape(json_tokens, unique.keys, unique.root, unique.domains, unique.root_domain)

    def accept(self, token: int) -> None:
        self._tokens.push(token)
        if self._shape is not None:
            self._shape.accept(token)
        if self._digits is None:
            return
        digits = self._digits.texts.get(token)
        counting = self._counting
        if digits is None:
            self._digit_run = 0
            counting.push(token)
        elif self._digit_run:  # the run goes on: the same item, a longer number
            self._digit_run += len(digits)
            counting.values[-1] += digits
        else:
            self._digit_run = len(digits)
            counting.push(DIGITS, digits)

    def banned(self) -> frozenset[int] | set[int]:
        """The tokens the next mask must not allow (empty: no loop, no item about to copy an earlier one, no key
        about to repeat one of its object)."""
        out = self._loop_bans()
        if self._shape is not None:
            copies = self._shape.duplicate_endings() + self._shape.duplicate_keys()
            if copies:
                return out | set(copies)
        return out

    def _loop_bans(self) -> frozenset[int] | set[int]:
        tokens, counting = self._tokens, self._counting
        if not (tokens.runs or tokens.lengths or self._digit_run >= MAX_DIGIT_RUN) and (
            counting is None or not (counting.runs or counting.lengths)
        ):
            return _NOTHING  # the common case: nothing repeats, nothing was banned before
        out = set()
        if p := tokens.period():
            # the shortest period is the loop; its multiples continue with the same token
            tokens.remember(p, tokens.items[-p])
            out.add(tokens.items[-p])
        out |= tokens.remembered()
        if counting is None:
            return out or _NOTHING
        if not out and (p := counting.period()) and self._counts_up(p):
            after = counting.items[-p]
            if after != DIGITS:  # the loop's next item is a number: its token comes once the digits end
                counting.remember(p, after)
                out.add(after)
        out |= counting.remembered()
        if self._digit_run >= MAX_DIGIT_RUN:
            out |= self._digits.ids
        return out or _NOTHING

    def narrowing(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Bitmasks for the next mask (json_shape.py): the tokens to keep only (those that close a stalled string,
        or a stalled array or object; in a unique array of a closed set, those that write a value not used yet), and
        the tokens to drop (those that would end the last item of a stalled container and write a comma in one
        token). None: not narrowed that way."""
        shape = self._shape
        if shape is None:
            return None, None
        keep = None
        if choices := shape.unique_choices():
            keep = self._json.bitmask(choices)
        elif shape.string_stalled():
            keep = self._json.string_closers
        elif shape.container_stalled():
            keep = self._json.container_closers
        drop = self._json.end_and_comma if shape.item_may_be_last() else None
        return keep, drop

    def _counts_up(self, p: int) -> bool:
        """The last three periods of the counting sequence: some numbers change, each by the same positive step both
        times, and the period holds a word (a list of plain numbers going up is left alone; so are numbers that
        merely happen to grow, as a step that stays the same twice over every changing number rarely happens)."""
        items, values = self._counting.items, self._counting.values
        if len(items) < 3 * p or not any(t in self._digits.wordy for t in items[-p:]):
            return False
        triples = [abc for abc in zip(values[-3 * p : -2 * p], values[-2 * p : -p], values[-p:]) if len(set(abc)) > 1]
        if any(len(v) > MAX_COUNTED_DIGITS for abc in triples for v in abc):
            return False
        steps = [(int(b) - int(a), int(c) - int(b)) for a, b, c in triples]
        return bool(steps) and all(0 < up == again for up, again in steps)
