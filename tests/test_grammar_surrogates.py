"""UTF-8-encoded surrogates (ED A0-BF xx) kept out of constrained outputs: xgrammar's automata for negated classes
take them (a random-weight model wrote one in about 64 outputs of `[^a]{40}`, and the text failed its regex).
GrammarService with the real backends and the default tokenizer; no model."""

from __future__ import annotations

import json

import pytest
import torch
from test_grammar_compile_cache import collect, make_service

from gramserve.grammar.backends import vocab_bytes
from gramserve.messages import GrammarCompileReq, GrammarRequest, GrammarStepReq
from gramserve.sampling.bitmask import allocate_bitmask


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


@pytest.mark.parametrize(
    ("kind", "text"),
    [("regex", "[^a]{40}"), ("regex", r"\W{20}"), ("json_schema", json.dumps({"type": "string"}))],
)
def test_a_lone_ed_byte_is_never_continued_into_a_surrogate(tokenizer, kind, text):
    tokens = vocab_bytes(tokenizer).tokens
    ed, a5, x9f = (tokens.index(b) for b in (b"\xed", b"\xa5", b"\x9f"))
    svc = make_service(tokenizer, default_backend="xgrammar")
    try:
        svc.submit(GrammarCompileReq("r", GrammarRequest(kind, text, backend="xgrammar")))
        assert collect(svc, {"r"})["r"].error is None
        prefix = [tokens.index(b'"')] if kind == "json_schema" else []
        for step, token in enumerate(prefix + [ed], start=1):
            resp = svc.step(GrammarStepReq(step, [("r", token)], [("r", 0)], []))
            assert not resp.rejected and not resp.failed, resp
        row = svc.bitmask[0]
        assert not allowed(row, a5) and allowed(row, x9f)  # ED 9F (U+D7C0-U+D7FF) is a character; ED A5 is not
        raw = allocate_bitmask(1, len(tokenizer))
        svc.matchers["r"].fill_bitmask(raw, 0)
        assert allowed(raw[0], a5), "xgrammar allows the surrogate: the guard is what keeps it out"
        # Once the character is whole, nothing more is banned.
        svc.step(GrammarStepReq(9, [("r", x9f)], [("r", 0)], []))
        assert "r" not in svc.surrogates.pending
    finally:
        svc.close()
