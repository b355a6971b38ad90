"""Bounded JSON whitespace in the xgrammar backend: the inlined grammar is xgrammar's own, only faster to fill.

``inline_bounded_whitespace`` rewrites the repetitions ``whitespace_k{0, n}`` that xgrammar generates for
``max_whitespace_cnt=n``. Here matchers of the rewritten grammar (what the backend compiles) and of xgrammar's
unmodified ``compile_json_schema`` walk the same tokens over real corpus schemas, along valid instances in
several spacings and along random walks through the allowed tokens, and must fill identical masks at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gramserve.grammar.backends import GrammarCompileError, GrammarOptions, GrammarSpec, create_backend
from gramserve.grammar.backends.xgrammar_backend import inline_bounded_whitespace
from tests.grammar_eval import small_cases

xgr = pytest.importorskip("xgrammar")

CORPUS = Path(__file__).parents[1] / ".." / "shared" / "corpora" / "jsonschemabench-dev"
SCHEMAS = 10
WALK_STEPS = 40

needs_corpus = pytest.mark.skipif(not CORPUS.is_dir(), reason=f"corpus not found at {CORPUS}")


@pytest.fixture(scope="module")
def backend(tokenizer):
    return create_backend(
        "xgrammar",
        tokenizer,
        len(tokenizer),
        [tokenizer.eos_token_id],
        GrammarOptions(max_whitespace=2, strict_json=True),
    )


def reference(backend, schema: str):
    """xgrammar's own grammar for the same options, with its bounded repetitions."""
    return backend.compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=2, strict_mode=True)


def masks(matcher, bitmask: torch.Tensor, row: int) -> torch.Tensor:
    matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask[row].clone()


def spacings(value) -> list[str]:
    """The instance compact, json.dumps-style, and with a newline + one space at each separator."""
    out = [json.dumps(value, separators=(",", ":")), json.dumps(value)]
    out.append(json.dumps(value, separators=(",\n ", ":\n ")))
    return out


def test_rewrite_replaces_every_bounded_repetition():
    schema = json.dumps(
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array"}}, "required": ["a"]}
    )
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=3, strict_mode=True))
    assert "whitespace_1{0, 3}" in ebnf or "whitespace{0, 3}" in ebnf
    fixed = inline_bounded_whitespace(ebnf)
    assert "{0, 3}" not in fixed
    assert '("" | [ \\n\\r\\t] | [ \\n\\r\\t] [ \\n\\r\\t] | [ \\n\\r\\t] [ \\n\\r\\t] [ \\n\\r\\t])' in fixed
    # Unbounded whitespace has no such rules: nothing to do.
    plain = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=True))
    assert inline_bounded_whitespace(plain) == plain


def test_rewrite_leaves_other_whitespace_rules_alone():
    ebnf = 'root ::= "a" whitespace{0, 2} "b"\nwhitespace ::= (([ ]))\n'
    assert inline_bounded_whitespace(ebnf) == ebnf


def test_rewrite_leaves_string_literals_alone(backend, tokenizer):
    """A schema whose constant text looks like a repetition: the literal stays, the grammar still accepts it."""
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"k": {"enum": ["whitespace{0, 2}", 'a"whitespace_3{0, 2}']}},
            "required": ["k"],
        }
    )
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=2, strict_mode=True))
    fixed = inline_bounded_whitespace(ebnf)
    literal_rules = [line for line in ebnf.splitlines() if line.startswith("root_prop_0 ::=")]
    assert literal_rules and "whitespace{0, 2}" in literal_rules[0]
    assert literal_rules[0] in fixed.splitlines() and "{0, 2}" not in fixed.replace(literal_rules[0], "")
    compiled = backend.compile(GrammarSpec("json_schema", schema))
    for text in ('{"k": "whitespace{0, 2}"}', '{"k":"a\\"whitespace_3{0, 2}"}'):
        m = xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)), text
        assert m.is_completed()


@needs_corpus
def test_same_masks_as_xgrammar_on_corpus_schemas(backend, tokenizer):
    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    bitmask = torch.zeros((2, (vocab + 31) // 32), dtype=torch.int32)
    checked = schemas = 0
    for path, text, valid in small_cases(CORPUS, 30, 3000):
        try:
            ours = backend.compile(GrammarSpec("json_schema", text))
            ref = reference(backend, text)
        except (GrammarCompileError, RuntimeError):
            continue
        schemas += 1
        # Valid instances in several spacings.
        for instance in spacings(valid[0]):
            a, b = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(ref)
            for tok in tokenizer.encode(instance, add_special_tokens=False):
                assert torch.equal(masks(a, bitmask, 0), masks(b, bitmask, 1)), (path.name, instance)
                checked += 1
                ok = b.accept_token(tok)
                assert a.accept_token(tok) == ok
                if not ok:
                    break
        # Random walks through the allowed tokens (whitespace runs, string contents, numbers, ...).
        a, b = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(ref)
        for _ in range(WALK_STEPS):
            if b.is_terminated():
                break
            ref_mask = masks(b, bitmask, 1)
            assert torch.equal(masks(a, bitmask, 0), ref_mask), path.name
            checked += 1
            allowed = np.flatnonzero(np.unpackbits(ref_mask.numpy().view(np.uint8), bitorder="little")[:vocab])
            tok = int(rng.choice(allowed))
            assert a.accept_token(tok) and b.accept_token(tok)
        if schemas == SCHEMAS:
            break
    assert schemas == SCHEMAS and checked > 500


PARSERS = ["hermes", "qwen25", "llama3", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "kimi_k2"]


@pytest.mark.parametrize("parser_name", PARSERS)
def test_tool_call_tags_same_masks_as_xgrammar(backend, tokenizer, parser_name):
    """Tool-call structural tags (json_schema arguments with the whitespace bound injected): the tag compiled
    through its printed grammar with the repetitions written out fills the masks xgrammar's own compile fills,
    along a rendered parallel call and along random walks."""
    from gramserve.parsers.tool_calls import get_tool_call_parser
    from gramserve.parsers.tool_calls.base import ToolFunction

    tools = [
        ToolFunction(
            "get_weather",
            {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        ),
        ToolFunction(
            "search",
            {
                "type": "object",
                "properties": {"query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["query"],
            },
        ),
    ]
    parser = get_tool_call_parser(parser_name)(tools)
    tag = backend._structural_tag_json(json.dumps(parser.structural_tag("required", True)))
    ebnf = str(xgr.Grammar.from_structural_tag(tag))
    if '"json_schema"' in tag:  # arguments as JSON with a whitespace bound (pythonic calls have a grammar of their own)
        assert inline_bounded_whitespace(ebnf) != ebnf
    ours = backend.compile(GrammarSpec("structural_tag", json.dumps(parser.structural_tag("required", True))))
    ref = backend.compiler.compile_structural_tag(tag)
    text = parser.render_calls(
        [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "x y", "tags": ["a"]})]
    )
    vocab = len(tokenizer)
    bitmask = torch.zeros((2, (vocab + 31) // 32), dtype=torch.int32)
    a, b = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(ref)
    steps = 0
    for tok in tokenizer.encode(text, add_special_tokens=False):
        assert torch.equal(masks(a, bitmask, 0), masks(b, bitmask, 1)), (parser_name, steps)
        ok = b.accept_token(tok)
        assert a.accept_token(tok) == ok
        steps += 1
        if not ok:
            break
    rng = np.random.default_rng(1)
    a, b = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(ref)
    for _ in range(WALK_STEPS):
        if b.is_terminated():
            break
        ref_mask = masks(b, bitmask, 1)
        assert torch.equal(masks(a, bitmask, 0), ref_mask), parser_name
        allowed = np.flatnonzero(np.unpackbits(ref_mask.numpy().view(np.uint8), bitorder="little")[:vocab])
        tok = int(rng.choice(allowed))
        assert a.accept_token(tok) and b.accept_token(tok)
        steps += 1
    assert steps > 20
