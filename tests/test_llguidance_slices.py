"""llguidance's token slices are a speed-up only: with the backend's finer slices (`TOKEN_SLICES`) every mask of a
random walk equals the mask under llguidance's default slices, on grammars whose strings have maxLength."""

from __future__ import annotations

import json
import random
from pathlib import Path

import llguidance as llg
import llguidance.hf
import llguidance.torch as llt
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from gramserve.grammar.backends.llguidance_backend import TOKEN_SLICES
from gramserve.model.loader import default_tokenizer_dir

SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "speed_suite"
BOUNDED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 7},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 13}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 33, "pattern": "^[a-z ]+$"},
    },
    "required": ["code", "tags", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizers():
    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    ours = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id, slices=TOKEN_SLICES)
    default = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id)
    return tok, ours, default


@pytest.mark.parametrize("name", ["extraction_record", "bounded", "support_ticket"])
def test_finer_slices_give_the_same_masks(tokenizers, name):
    tok, ours, default = tokenizers
    schema = BOUNDED if name == "bounded" else json.loads((SUITE / f"{name}.json").read_text())["grammar"]
    grammar = llg.grammar_from("json_schema", json.dumps(schema))
    masks = llt.allocate_token_bitmask(2, len(tok))
    rng = random.Random(name)
    checked = 0
    for _ in range(4):
        a, b = llg.LLMatcher(ours, grammar, log_level=0), llg.LLMatcher(default, grammar, log_level=0)
        for _ in range(80):
            llt.fill_next_token_bitmask(a, masks, 0)
            llt.fill_next_token_bitmask(b, masks, 1)
            assert torch.equal(masks[0], masks[1]), f"masks differ after {checked} checks"
            checked += 1
            bits = np.unpackbits(masks[0].numpy().view(np.uint8), bitorder="little")[: len(tok)]
            allowed = np.flatnonzero(bits).tolist()
            if a.is_stopped() or not allowed:
                break
            token = rng.choice(allowed)  # a random walk, as random weights at temperature 1.0 take
            assert a.consume_token(token) and b.consume_token(token)
    assert checked > 40
