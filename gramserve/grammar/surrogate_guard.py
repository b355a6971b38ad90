"""Keeps UTF-8-encoded surrogates out of constrained outputs.

xgrammar's byte automata for `.`, negated classes, `\\S`, `\\W` and JSON strings take ED A0-BF xx: the
three-byte form of U+D800-U+DFFF, which no UTF-8 text holds (checked with xgrammar 0.2.8; llguidance and
outlines-core refuse it). A random-weight model at temperature 1.0 wrote one in about 64 outputs of `[^a]{40}`,
whose text came back with three U+FFFD in place of one character and failed its regex. The surrogate's bytes
arrive as byte tokens, so the guard follows each request's output: a row whose output ends with a lone ED byte may
not take a token that starts with A0-BF (the vocabularies hold no token with ED A0-BF inside it).
"""

from __future__ import annotations

from gramserve.grammar.backends import vocab_bytes

SURROGATE_LEAD = 0xED  # U+D000-U+DFFF start with ED; A0-BF after it makes a surrogate
SURROGATE_SECOND = range(0xA0, 0xC0)


class SurrogateGuard:
    """Per request: does its output end with a lone ED byte? Those rows lose the tokens that would continue it
    into a surrogate."""

    def __init__(self, ends_with_lead: frozenset[int], completes: frozenset[int]):
        self.ends_with_lead = ends_with_lead  # token ids ending with ED (two in SmolLM2's vocabulary)
        self.completes = completes  # token ids starting with A0-BF
        self.pending: set[str] = set()  # requests whose output ends with a lone ED

    @classmethod
    def of(cls, tokenizer) -> SurrogateGuard:
        tokens = vocab_bytes(tokenizer).tokens
        ends = frozenset(i for i, t in enumerate(tokens) if t and t[-1] == SURROGATE_LEAD)  # ED is always a lead
        completes = frozenset(i for i, t in enumerate(tokens) if t and t[0] in SURROGATE_SECOND)
        return cls(ends, completes)

    def accept(self, rid: str, token: int) -> None:
        if token in self.ends_with_lead:  # a set lookup: this runs for every accepted token of every row
            self.pending.add(rid)
        elif self.pending:
            self.pending.discard(rid)

    def forget(self, rid: str) -> None:
        self.pending.discard(rid)
