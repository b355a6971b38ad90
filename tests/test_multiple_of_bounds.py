"""Numeric ranges next to `multipleOf` (a new user's finding): llguidance 1.9.1 lost the multiples of a range whose
bounds are not multiples themselves (0.5..0.5051 by 0.01 allowed nothing, so a valid request got a 400), and
xgrammar ignores `multipleOf` on numbers. The schema's bounds are now moved onto multiples before a compile
(schema_normalize.aligned_multiple_bounds), and `auto` no longer takes xgrammar for such a schema as exact."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import pytest
import torch

from gramserve.grammar.backends import create_backend
from gramserve.grammar.compile_process import compile_grammar
from gramserve.grammar.schema_audit import unenforced
from gramserve.grammar.schema_normalize import aligned_multiple_bounds
from gramserve.messages import GrammarRequest

RANGES = [
    ({"minimum": 0.5, "maximum": 0.5051}, 0.01, {"0.5"}),
    ({"minimum": 0.5, "maximum": 0.505}, 0.01, {"0.5"}),
    ({"minimum": 0.49, "maximum": 0.505}, 0.01, {"0.49", "0.5"}),
    ({"minimum": 0.495, "maximum": 0.505}, 0.01, {"0.5"}),
    ({"minimum": 0.5, "maximum": 0.55}, 0.1, {"0.5"}),
    ({"exclusiveMinimum": 0.5, "exclusiveMaximum": 0.53}, 0.01, {"0.51", "0.52"}),
    ({"minimum": 1, "maximum": 2.9}, 0.75, {"1.5", "2.25"}),
]


@pytest.mark.parametrize(
    "schema, expected",
    [
        ({"type": "number", "multipleOf": 0.01, "minimum": 0.495, "maximum": 0.5051}, (0.5, 0.5)),
        ({"type": "number", "multipleOf": 0.01, "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.53}, (0.51, 0.52)),
        ({"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 12}, (5, 10)),
        ({"type": "number", "multipleOf": 0.25, "minimum": -1.1}, (-1, None)),
    ],
)
def test_bounds_move_onto_the_multiples_inside_them(schema, expected):
    node = aligned_multiple_bounds({"type": "object", "properties": {"x": schema}})["properties"]["x"]
    assert (node.get("minimum"), node.get("maximum")) == expected
    assert "exclusiveMinimum" not in node and "exclusiveMaximum" not in node


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "multipleOf": 0.01, "minimum": 0.5, "maximum": 0.6},  # already on multiples
        {"type": "number", "multipleOf": 0.01, "minimum": 0.501, "maximum": 0.509},  # no multiple: the backends say
        {"type": "number", "minimum": 0.5, "maximum": 0.6},
        {"type": "number", "multipleOf": 0.5, "minimum": 1, "exclusiveMaximum": True, "maximum": 3},  # draft 4
    ],
)
def test_schemas_that_need_no_alignment_are_left_as_they_are(schema):
    assert aligned_multiple_bounds(schema) is schema


@pytest.fixture(scope="module")
def llguidance(tokenizer):
    return create_backend("llguidance", tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("bounds, step, values", RANGES)
def test_llguidance_writes_every_multiple_in_the_range_and_nothing_else(llguidance, tokenizer, bounds, step, values):
    """Random walks over the compiled grammar (every allowed token equally likely) reach each multiple in the range
    and only those."""
    schema = {"type": "number", "multipleOf": step, **bounds}
    compiled = compile_grammar(llguidance, GrammarRequest("json_schema", json.dumps(schema)))
    words = (len(tokenizer) + 31) // 32
    seen = set()
    for seed in range(40):
        rng, matcher, text = random.Random(seed), llguidance.matcher(compiled), ""
        for _ in range(12):
            mask = torch.zeros((1, words), dtype=torch.int32)
            matcher.fill_bitmask(mask, 0)
            row = mask[0].tolist()
            allowed = [i for i in range(len(tokenizer)) if (row[i // 32] >> (i % 32)) & 1]
            assert allowed, f"nothing allowed after {text!r}"
            token = rng.choice(allowed)
            if token == tokenizer.eos_token_id:
                break
            assert matcher.accept_token(token)
            text += tokenizer.decode([token])
        seen.add(str(Decimal(text).normalize()) if text else text)
    assert seen == {str(Decimal(v).normalize()) for v in values}


def test_xgrammar_is_not_taken_as_exact_for_multiple_of_on_numbers():
    assert "multipleOf on numbers" in unenforced("xgrammar", json.dumps({"type": "number", "multipleOf": 0.5}))
    assert unenforced("xgrammar", json.dumps({"type": "integer", "multipleOf": 5})) == []
