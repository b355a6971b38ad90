"""xgrammar's masks keep only the tokenizer's own token where the grammar forces the next characters
(grammar/backends/forced_text.py): after `{"` with "name" the only key, "name" and not "n", "na" or "nam", as
llguidance's masks do. A greedy model took "n" and derailed, and the same request changed its answer once auto
moved the schema from llguidance to xgrammar (a new user's finding)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from gramserve.grammar.backends import create_backend
from gramserve.grammar.compile_process import compile_grammar
from gramserve.messages import GrammarRequest

SUITE = Path(__file__).parents[1] / "benchmarks" / "speed_suite"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 13},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backends(tokenizer):
    eos = [tokenizer.eos_token_id]
    return {name: create_backend(name, tokenizer, len(tokenizer), eos) for name in ("xgrammar", "llguidance")}


def allowed(matcher, tokenizer) -> set[int]:
    mask = torch.zeros((1, (len(tokenizer) + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    row = mask[0].tolist()
    return {i for i in range(len(tokenizer)) if (row[i // 32] >> (i % 32)) & 1}


def test_a_forced_key_is_the_tokenizers_token(backends, tokenizer):
    grammar = GrammarRequest("json_schema", json.dumps(PERSON))
    masks = {}
    for name, backend in backends.items():
        matcher = backend.matcher(compile_grammar(backend, grammar))
        for token in tokenizer.encode('{"', add_special_tokens=False):
            assert matcher.accept_token(token)
        masks[name] = allowed(matcher, tokenizer)
    assert [tokenizer.decode([t]) for t in masks["xgrammar"]] == ["name"]
    assert masks["xgrammar"] == masks["llguidance"]


@pytest.mark.parametrize("path", sorted(SUITE.glob("*.json")), ids=lambda p: p.stem)
def test_no_token_ends_inside_forced_text_but_the_tokenizers_own(backends, tokenizer, path):
    """Random walks over xgrammar's masks for each grammar of the speed suite: wherever the grammar forces two or
    more characters, every allowed token covers them all or is the tokenizer's first token of them."""
    case = json.loads(path.read_text())
    text = case["grammar"] if isinstance(case["grammar"], str) else json.dumps(case["grammar"])
    backend = backends["xgrammar"]
    compiled = compile_grammar(backend, GrammarRequest(case["kind"], text))
    token_bytes = backend.vocab.tokens
    forced_seen = 0
    for seed in range(3):
        rng, matcher = random.Random(seed), backend.matcher(compiled)
        for _ in range(80):
            if matcher.is_terminated():
                break
            ids = allowed(matcher, tokenizer)
            forced = matcher._m.find_jump_forward_string().encode()
            if len(forced) >= 2:
                forced_seen += 1
                first = tokenizer.encode(forced.decode(), add_special_tokens=False)[0]
                inside = [t for t in ids if t != first and forced.startswith(token_bytes[t] or b"\0" * 99)]
                inside = [t for t in inside if len(token_bytes[t]) < len(forced)]
                assert not inside, (forced, [tokenizer.decode([t]) for t in inside])
            token = rng.choice(sorted(ids))
            if token == tokenizer.eos_token_id:
                break
            assert matcher.accept_token(token)
    if case["kind"] == "json_schema":
        assert forced_seen > 0  # property names at least
