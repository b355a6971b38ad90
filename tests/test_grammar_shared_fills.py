"""Rows in one matcher state fill once a step (grammar/shared_fills.py): state keys follow the grammar and the
accepted tokens; a grammar service that shares fills writes exactly the masks of one that fills every row, loop
guard narrowing included, with llguidance and xgrammar, while requests of one schema write the same tokens, part,
and meet again in a state reached by other tokens (then they fill apart: the key is the history, not the state)."""

from __future__ import annotations

import json

import pytest
import torch

from gramserve.grammar.backends import GrammarOptions
from gramserve.grammar.service import GrammarService
from gramserve.grammar.shared_fills import StateKeys
from gramserve.messages import GrammarCompileReq, GrammarRequest, GrammarStepReq
from gramserve.sampling.bitmask import allocate_bitmask
from tests.test_grammar_compile_cache import EOS, collect

GRAMMAR_A = ("llguidance", "json_schema", '{"type": "string"}')
GRAMMAR_B = ("llguidance", "json_schema", '{"type": "integer"}')


def test_keys_follow_the_grammar_and_the_tokens():
    keys = StateKeys()
    for rid, grammar in (("a1", GRAMMAR_A), ("a2", GRAMMAR_A), ("a3", GRAMMAR_A), ("b", GRAMMAR_B)):
        keys.start(rid, grammar)
    assert keys.split(["a1", "a2", "a3", "b"]) == ([0, 3], [(1, 0), (2, 0)])  # b: another grammar
    for rid, token in (("a1", 5), ("a2", 5), ("a3", 6), ("b", 5)):
        keys.accept(rid, token)
    assert keys.split(["a3", "a1", "b", "a2"]) == ([0, 1, 2], [(3, 1)])  # a3 took another token
    keys.accept("a1", 7)
    keys.accept("a2", 7)
    keys.forget("a1")  # gone, or its matcher refused a token: it fills on its own
    assert keys.split(["a1", "a2", "unknown"]) == ([0, 1, 2], [])


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "note": {"type": "string"},
    },
    "required": ["name", "tags", "note"],
    "additionalProperties": False,
}


def _service(tokenizer, share: bool) -> GrammarService:
    return GrammarService(
        tokenizer,
        len(tokenizer),
        [EOS],
        GrammarOptions(loop_guard=True),
        allocate_bitmask(16, len(tokenizer)),
        fill_threads=0,
        compile_timeout_s=30,
        share_fills=share,
    )


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_sharing_service_writes_the_masks_of_one_that_fills_every_row(tokenizer, backend):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    head, tail, la = enc('{"name": "'), enc('", "tags": ["x"], "note": "'), enc("la") * 40
    loop = head + enc("Ada") + tail + la  # the loop guard bans "la" on the way, and remembers the ban
    after = enc("la") * 6  # the remembered ban comes back here
    # r0 and r2 follow one text; r1 parts from them after the loop (its guard must have remembered the ban like
    # theirs); r3 writes another text; r4 parts from r0 after the head and meets it again in the same state after
    # another name; r5 follows r0's text on another schema.
    texts = {"r0": loop + enc("c") + after, "r1": loop + enc("b") + after, "r2": loop + enc("c") + after}
    texts |= {"r3": head + enc("Bob") + enc('", "tags": [], "note": "') + la + enc("c") + after}
    texts |= {"r4": head + enc("Al") + tail + la + enc("c") + after, "r5": loop + enc("c") + after}
    schemas = {rid: SCHEMA for rid in texts}
    schemas["r5"] = {**SCHEMA, "properties": {**SCHEMA["properties"], "note": {"type": "string", "maxLength": 200}}}
    services = [_service(tokenizer, share) for share in (True, False)]
    try:
        for svc in services:
            for rid, schema in schemas.items():
                svc.submit(GrammarCompileReq(rid, GrammarRequest("json_schema", json.dumps(schema), backend=backend)))
            assert all(r.error is None for r in collect(svc, set(schemas)).values())
        shared = bans = 0
        for step in range(len(texts["r0"]) + 1):
            accept = [(rid, text[step - 1]) for rid, text in texts.items() if 0 < step <= len(text)]
            fill = [(rid, 2 * k + 1) for k, rid in enumerate(texts)]  # rows in another order than the rids
            answers = [svc.step(GrammarStepReq(step, accept, fill, [])) for svc in services]
            assert all(a.rejected == [] and not a.failed for a in answers), answers
            assert torch.equal(services[0].bitmask, services[1].bitmask), f"step {step}"
            shared += answers[0].shared_fills
            bans += answers[1].loop_bans
            assert answers[1].shared_fills == 0
        # r2 copies r0 at every step, r1 until it parts, r4 too; r5 (another schema) never.
        assert shared >= len(texts["r0"]) + 1 + len(loop) + 1 + len(head)
        assert bans > 0  # the guard narrowed rows, and the copies carry its narrowing
    finally:
        for svc in services:
            svc.close()
