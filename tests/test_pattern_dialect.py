"""Patterns read one way by the grammars, the last check and jsonschema (Python's `re`): POSIX classes, nested
classes, Rust's class set operators, \\A / \\Z and optional groups made to mean what `re` reads (a random-weight
model wrote "orumG" for `^[[:alpha:]]+$`, which llguidance and the check read as letters and jsonschema refuses).
GrammarService with the real backends; no model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_grammar_compile_cache import collect, make_service

from gramserve.grammar.pattern_dialect import for_backends, problem
from gramserve.grammar.schema_checks import schema_problem
from gramserve.messages import GrammarCompileReq, GrammarRequest
from gramserve.server.output_check import OutputChecker

CASES = [  # pattern, a string re matches, a string the other dialects would have let through
    (r"^[[:alpha:]]+$", "a]", "orumG"),
    (r"^[a-z&&[^aeiou]]{1,4}$", "&]", "bcd"),
    (r"\A[0-9]{1,3}\Z", "575", "575Z"),
    (r"^[]a]{2}$", "]a", "ab"),
    # xgrammar 0.2.9 made each part of an optional group optional when one part repeats (found by a probe as a user)
    (r"^a(bc+)?Z$", "abccZ", "acZ"),
    (r"^\+?(?:1[0-9]{1,2})?-\d{3}$", "+12-345", "+2-345"),
]


@pytest.mark.filterwarnings("ignore:Possible:FutureWarning")  # re's own warning about these very patterns
@pytest.mark.parametrize(("pattern", "good", "bad"), CASES)
def test_the_rewrite_reads_as_python_re(pattern, good, bad):
    assert re.search(pattern, good) and not re.search(pattern, bad)
    assert re.search(for_backends(pattern), good) and not re.search(for_backends(pattern), bad)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_grammars_and_the_last_check_agree_with_jsonschema(tokenizer, backend):
    svc, checker = make_service(tokenizer, default_backend=backend), OutputChecker()
    try:
        for k, (pattern, good, bad) in enumerate(CASES):
            schema = {"type": "string", "pattern": pattern}
            text = json.dumps(schema)
            assert schema_problem(text) is None
            rids = {f"g{k}", f"b{k}"}
            for rid in rids:
                svc.submit(GrammarCompileReq(rid, GrammarRequest("json_schema", text, backend=backend)))
            assert all(r.error is None for r in collect(svc, rids).values())
            for rid, value in ((f"g{k}", good), (f"b{k}", bad)):
                m = svc.matchers[rid]
                ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
                took = all(m.accept_token(t) for t in ids) and m.can_terminate()
                assert took == (value == good), (backend, pattern, value)
                assert jsonschema.Draft202012Validator(schema).is_valid(value) == (value == good)
                result = checker.check_now(GrammarRequest("json_schema", text), json.dumps(value))
                assert result.checked and (result.error is None) == (value == good), (pattern, value, result)
    finally:
        svc.close()


def test_p_without_braces_is_refused():
    assert "without braces" in problem(r"^\pL{1,4}$") and problem(r"^\p{L}+$") is None
    assert "without braces" in schema_problem(json.dumps({"type": "string", "pattern": r"\pL+"}))
