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
