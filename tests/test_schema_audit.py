"""What a backend compiles without enforcing (grammar/schema_audit.py): `auto` passes such a schema to the next
backend, and an explicit backend refuses it with a 400."""

from __future__ import annotations

import json

import pytest

from gramserve.grammar.schema_audit import XGRAMMAR_FORMATS, unenforced


@pytest.mark.parametrize("fmt", ["iri", "idn-email", "idn-hostname", "iri-reference", "regex"])
def test_formats_xgrammar_compiles_as_any_string_are_unenforced(fmt):
    """A new user's finding: `auto` served `"format": "iri"` with xgrammar, which wrote free text ("a ble") that
    the last check then failed at every retry; these formats now go on to the relaxed candidate."""
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}
    assert f"format {fmt!r}" in unenforced("xgrammar", json.dumps(schema))


def test_formats_xgrammar_enforces_pass():
    for fmt in sorted(XGRAMMAR_FORMATS):
        assert unenforced("xgrammar", json.dumps({"type": "string", "format": fmt})) == [], fmt


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "format": "int64"},  # not a string
        {"type": "string", "format": "password"},  # the last check knows no such format: nothing to hold it to
        {"type": "number", "format": "iri"},  # a format binds strings only
    ],
)
def test_formats_that_bind_nothing_leave_xgrammar_exact(schema):
    assert unenforced("xgrammar", json.dumps(schema)) == []


def test_xgrammar_rejects_what_the_audit_says_it_enforces(tokenizer):
    """The list is what xgrammar does: a string with spaces and braces is refused by each listed format."""
    xgr = pytest.importorskip("xgrammar")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    for fmt in sorted(XGRAMMAR_FORMATS):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps({"type": "string", "format": fmt})))
        assert not matcher.accept_string('"@@ not valid {{"'), fmt


def test_integer_bounds_past_2_53_are_unenforced_by_llguidance(tokenizer):
    """A new user's finding: llguidance reads integer bounds as doubles, so maximum 9007199254740999 let a walk write
    9007199254741000 (xgrammar keeps them exact): `auto` passes such schemas on. Bounds within 2**53 stay exact."""
    import llguidance

    big = {"type": "integer", "minimum": 9007199254740990, "maximum": 9007199254740999}
    assert unenforced("llguidance", json.dumps(big)) == ["integer bounds past 2**53"]
    assert unenforced("xgrammar", json.dumps(big)) == []
    assert unenforced("llguidance", json.dumps({"type": "integer", "minimum": 0, "maximum": 2**53})) == []
    assert unenforced("llguidance", json.dumps({"type": "number", "maximum": 1e300})) == []
    # what llguidance does: the grammar takes a value past the maximum
    grammar = llguidance.LLMatcher.grammar_from_json_schema(big)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    from llguidance.hf import from_tokenizer

    matcher = llguidance.LLMatcher(from_tokenizer(tokenizer), grammar)
    ids = tokenizer.encode("9007199254741000", add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
