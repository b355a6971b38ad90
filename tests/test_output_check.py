"""The last check of constrained outputs (server/output_check.py): real jsonschema validation, no model."""

from __future__ import annotations

import asyncio
import json

from gramserve.messages import GrammarRequest
from gramserve.server.output_check import CheckResult, OutputChecker

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "when": {"type": "string", "format": "date"}},
    "required": ["name"],
    "additionalProperties": False,
}


def grammar(schema, kind: str = "json_schema", **kw) -> GrammarRequest:
    return GrammarRequest(kind=kind, text=json.dumps(schema), **kw)


def test_valid_invalid_and_not_json():
    c = OutputChecker()
    g = grammar(SCHEMA)
    assert c.check_now(g, '{"name": "Ada", "when": "2024-02-29"}').error is None
    bad = c.check_now(g, '{"name": "Adalbert"}')
    assert bad.checked and "/name" in bad.error and "long" in bad.error
    assert "not JSON" in c.check_now(g, '{"name": "Ada"').error
    assert "additional" in c.check_now(g, '{"name": "A", "x": 1}').error.lower()


def test_a_repeated_key_fails_the_check():
    """llguidance and xgrammar let a patternProperties key repeat ({"a": 1, "b": 3, "a": 9} at temperature 1.0):
    json.loads keeps the last value and validates it, other parsers keep the first or refuse the object."""
    schema = {"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}, "additionalProperties": False}
    c = OutputChecker()
    assert c.check_now(grammar(schema), '{"a": 1, "b": 3}').error is None
    assert "repeats a key" in c.check_now(grammar(schema), '{"a": 1, "b": 3, "a": 9}').error
    assert "'x'" in c.check_now(GrammarRequest("json_object", ""), '{"o": {"x": 1, "x": 1}}').error


def test_numbers_are_read_as_decimals():
    schema = {"type": "number", "multipleOf": 0.01, "maximum": 10000.9}
    c = OutputChecker()
    assert c.check_now(grammar(schema), "10000.89").error is None  # 10000.89 / 0.01 is not whole in binary
    assert c.check_now(grammar(schema), "10000.891").error
    # An exponent past Decimal's range (random weights write them) is clamped to its edge and checked: sign,
    # integrality and order against bounds hold. An integer of more than 4300 digits, which Python will not read,
    # is left unchecked, never called "not JSON".
    assert c.check_now(grammar({"type": "integer"}), "1e9999999999999999999") == CheckResult(True, None)
    assert "maximum" in c.check_now(grammar({"type": "number", "maximum": 1e300}), "1e9999999999999999999").error
    assert c.check_now(grammar({"type": "number", "minimum": 0}), "2E-99999999999999999999").error is None
    # ... but over an exclusiveMinimum of 0 it is 0.0 to a client's parser (test_bounds_hold_as_a_double_too)
    assert "double" in c.check_now(grammar({"type": "number", "exclusiveMinimum": 0}), "2E-99999999999999999999").error
    assert c.check_now(grammar({"type": "integer"}), "-2E-99999999999999999999").error
    # a longer mantissa past the edge (an 8B run's outputs: a first version of the clamp raised there, a 500)
    for text in ("12.5e99999999999999999999", "-0.75E-99999999999999999999", "0.0e99999999999999999999"):
        assert c.check_now(grammar({"type": "number"}), text) == CheckResult(True, None), text
    result = c.check_now(grammar({"type": ["number", "integer"]}), "1" + "0" * 5000)
    assert not result.checked and result.error is None


def test_formats_are_checked():
    c = OutputChecker()
    assert "date" in c.check_now(grammar(SCHEMA), '{"name": "A", "when": "2024-02-30"}').error


def test_the_draft_named_by_the_schema_is_used():
    # Draft 4's exclusiveMaximum is a boolean; read as 2020-12 the schema itself would be invalid.
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "integer",
        "maximum": 5,
        "exclusiveMaximum": True,
    }
    c = OutputChecker()
    assert c.check_now(grammar(schema), "4").error is None
    assert c.check_now(grammar(schema), "5").error is not None


def test_json_object_and_unresolvable_refs():
    c = OutputChecker()
    assert c.check_now(GrammarRequest(kind="json_object", text=""), "[1]").error
    assert c.check_now(GrammarRequest(kind="json_object", text=""), '{"a": [1]}').error is None
    remote = {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}
    result = c.check_now(grammar(remote), '{"a": 1}')
    assert not result.checked  # never fetched: unchecked, not failed


def test_applies_only_to_whole_output_json_constraints():
    assert OutputChecker.applies(grammar(SCHEMA))
    assert OutputChecker.applies(GrammarRequest(kind="json_object", text=""))
    assert not OutputChecker.applies(None)
    assert not OutputChecker.applies(GrammarRequest(kind="regex", text="a+"))
    assert not OutputChecker.applies(grammar(SCHEMA, start_after="</think>"))


def test_a_slow_check_is_left_unchecked_and_counted():
    # A pattern that backtracks exponentially: the regex module gives up at its time limit, the output is unchecked.
    schema = {"type": "string", "pattern": "^(a|aa)+$"}
    c = OutputChecker()
    result = asyncio.run(c.check(grammar(schema), json.dumps("a" * 40 + "!")))
    assert not result.checked and c.stats["unchecked"] == 1
    assert c.check_now(grammar(schema), json.dumps("aaa")).error is None
    assert c.check_now(grammar(schema), json.dumps("ab")).error
    asyncio.run(c.check(grammar(SCHEMA), '{"name": "Adalbert"}'))
    asyncio.run(c.check(grammar(SCHEMA), '{"name": "Ada"}'))
    assert c.stats == {"checked": 1, "invalid": 1, "unchecked": 1, "retried": 0, "recovered": 0}


def test_integral_floats_count_as_integers():
    """JSON Schema's integers include 2.0: a schema's "maxLength": 2.0 is read (and checked) as 2, and an output 5.0
    is an integer. A GPU run had "maxLength": 2.0 left unchecked (the metaschema refused the Decimal)."""
    c = OutputChecker()
    assert c.check_now(grammar({"maxLength": 2.0}), json.dumps("abc")).error
    assert c.check_now(grammar({"maxLength": 2.0}), json.dumps("ab")).error is None
    assert c.check_now(grammar({"type": "integer"}), "5.0").error is None
    assert c.check_now(grammar({"type": "integer"}), "5.5").error


def test_tool_calls_are_checked_against_their_tools():
    """For the tool-call grammar of a chat request, the check reads the calls the response would return (the
    hermes format here) and validates each one's arguments against its tool's parameters."""
    from gramserve.parsers.tool_calls import ToolFunction, get_tool_call_parser
    from gramserve.server.tool_requests import ToolPlan

    params = {**SCHEMA, "if": {"properties": {"name": {"const": "Ada"}}}, "then": {"required": ["when"]}}
    plan = ToolPlan([ToolFunction("f", params)], "required", None, True, get_tool_call_parser("hermes"))
    tag = GrammarRequest(kind="structural_tag", text="{}")
    assert OutputChecker.target(tag, plan) is plan
    assert OutputChecker.target(tag, None) is None
    assert OutputChecker.target(GrammarRequest(kind="structural_tag", text="{}", start_after="</think>"), plan) is None
    assert OutputChecker.target(grammar(SCHEMA), plan).kind == "json_schema"  # a response_format wins

    def calls(*args: dict) -> str:
        return "\n".join(f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(a)}}}\n</tool_call>' for a in args)

    c = OutputChecker()
    assert c.check_now(plan, calls({"name": "Bo"}, {"name": "Ada", "when": "2024-01-01"})).error is None
    bad = c.check_now(plan, calls({"name": "Bo"}, {"name": "Ada"}))
    assert bad.checked and "'f'" in bad.error and "when" in bad.error
    assert "long" in c.check_now(plan, calls({"name": "Adalbert"})).error
    # A repeated call is not returned (chat_output.first_calls_until_repeat), so nothing after it is checked.
    assert c.check_now(plan, calls({"name": "Bo"}, {"name": "Bo"}, {"name": "Ada"})).error is None


def test_ecma_unicode_classes_in_patterns_and_property_names_are_checked():
    """\\p{L} is ECMA-262 but not Python's `re`: jsonschema's metaschema check and its patternProperties and
    additionalProperties matching raised on it, so 290 of 1,898 CloudFormation schemas went unchecked (and two
    invalid outputs got through). Patterns and property names are matched with the `regex` module now."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": r"^[\p{L}\p{Z}]+$"}},
        "patternProperties": {r"^\p{Lu}": {"type": "integer"}},
        "additionalProperties": False,
    }
    c = OutputChecker()
    assert c.check_now(grammar(schema), '{"name": "Zoë Ann", "X": 1}') == CheckResult(True, None)
    assert "does not match" in c.check_now(grammar(schema), '{"name": "Zoë 1"}').error
    assert c.check_now(grammar(schema), '{"Xy": "one"}').error  # a matching key: its schema applies
    assert "unexpected" in c.check_now(grammar(schema), '{"lower": 1}').error  # no pattern matches: additional
    assert c.check_now(grammar({"type": "object", "additionalProperties": {"type": "string"}}), '{"a": 1}').error


def test_checks_waiting_for_a_thread_are_not_given_up():
    """Many outputs finishing at once queue for the check threads; the time bound counts from when a thread takes a
    check, so none of them comes back unchecked (each check here takes about 0.3 s of a 0.5 s bound)."""
    import time

    c = OutputChecker(timeout_s=0.5)
    slow = c.check_now

    def check_now(target, text):
        time.sleep(0.3)
        return slow(target, text)

    c.check_now = check_now

    async def burst():
        return await asyncio.gather(*(c.check(grammar(SCHEMA), '{"name": "Ada"}') for _ in range(8)))

    results = asyncio.run(burst())
    assert all(r == CheckResult(True, None) for r in results) and c.stats["unchecked"] == 0


def test_a_check_that_fails_leaves_the_output_unchecked_not_the_request_failed():
    c = OutputChecker()

    def broken(target, text):
        raise RuntimeError("a bug in the check")

    c.check_now = broken
    assert asyncio.run(c.check(grammar(SCHEMA), '{"name": "Ada"}')) == CheckResult(False, None)
    assert c.stats["unchecked"] == 1


def test_multiples_of_long_numbers_are_checked_exactly():
    """jsonschema's multipleOf divides Decimals at 28 digits and raised DivisionImpossible on a 32-digit number (a
    new user's finding: the whole check gave up, so a relaxed schema's failing `pattern` went out as "stop")."""
    schema = {
        "type": "object",
        "properties": {
            "q": {"type": "number", "multipleOf": 0.25},
            "postal": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
    }
    c = OutputChecker()
    bad = c.check_now(grammar(schema), '{"q": 10000000000000002552243944572769, "postal": "USA"}')
    assert bad.checked and "/postal" in bad.error
    assert c.check_now(grammar(schema), '{"q": 10000000000000002552243944572769.75, "postal": "12345"}').error is None
    wrong = c.check_now(grammar(schema), '{"q": 10000000000000002552243944572769.1, "postal": "12345"}')
    assert wrong.checked and "multiple" in wrong.error
    assert "multiple" in c.check_now(grammar(schema), '{"q": 0.' + "5" * 5000 + "}").error  # past int()'s limit
    assert c.stats["unchecked"] == 0
    # A number past Decimal's range keeps only its sign and magnitude when read (output_number): its multiples
    # cannot be told, so it is left unchecked (3e99999999999999999999 is a multiple of 3; 1e... would not be).
    assert not c.check_now(grammar({"type": "number", "multipleOf": 3}), "3e99999999999999999999").checked
    assert not c.check_now(grammar(schema), '{"q": 1e-99999999999999999999}').checked


def test_bounds_hold_as_a_double_too():
    """0.999999999999999969999 is under an exclusiveMaximum of 1 as a decimal, but json.loads and pydantic read 1.0
    (a new user's finding: such an output came back as "stop" and pydantic refused it). Bounds hold both ways; draft
    4's boolean exclusive bounds keep jsonschema's own keywords."""
    schema = {"type": "object", "properties": {"h": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}}
    c = OutputChecker()
    bad = c.check_now(grammar(schema), '{"h": 0.999999999999999969999}')
    assert bad.checked and "as a double" in bad.error, bad
    assert c.check_now(grammar(schema), '{"h": 1e-400}').error is not None  # 0.0 as a double
    assert c.check_now(grammar(schema), '{"h": 0.99999999}').error is None
    assert c.check_now(grammar(schema), '{"h": 1}').error is not None
    inclusive = {"type": "integer", "minimum": 5, "maximum": 9007199254740993}
    assert c.check_now(grammar(inclusive), "9007199254740993").error is None  # 9007199254740992.0 as a double: fine
    assert c.check_now(grammar(inclusive), "4").error is not None
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "number",
        "maximum": 1,
        "exclusiveMaximum": True,
    }
    assert c.check_now(grammar(draft4), "1").error is not None
    assert c.check_now(grammar(draft4), "0.5").error is None
    # ... and hold as a double too (draft 4's exclusive bounds were checked exactly only)
    assert "as a double" in c.check_now(grammar(draft4), "0.99999999999999999999").error
    assert c.check_now(grammar({**draft4, "exclusiveMaximum": False}), "1").error is None


def test_a_required_call_the_parser_cannot_read_fails_the_check():
    """The pythonic grammar allows a number past the doubles (a=1114E492136051623994), which the parser cannot turn
    into JSON arguments: a required call came back as content with finish_reason stop. Cut at max_tokens, an output
    without a whole call stays what it is ("length")."""
    from dataclasses import replace

    from gramserve.parsers.tool_calls import TOOL_CALL_PARSERS, ToolFunction
    from gramserve.server.tool_requests import ToolPlan

    params = {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}
    plan = ToolPlan([ToolFunction("add", params)], "required", None, True, TOOL_CALL_PARSERS["pythonic"])
    c = OutputChecker()
    assert c.check_now(plan, "[add(a=1.5)]").error is None
    assert "holds no call" in c.check_now(plan, "[add(a=1114E492136051623994)]").error
    assert c.check_now(replace(plan, whole=False), "[add(a=1114E492136051623994)]").error is None
    assert c.check_now(replace(plan, mode="auto"), "no call today").error is None
