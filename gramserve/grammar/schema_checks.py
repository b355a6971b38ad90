"""Checks of a JSON schema that no backend can serve correctly, run with its compile (off the request path: the
metaschema check of a large schema takes tens of ms): the request gets a 400 that says where, instead of a compile
that goes through and outputs that cannot validate (or cannot be checked).

- The schema against its draft's metaschema, for structure only (`"required": "a"`, `"multipleOf": -3`,
  `"type": []`). Formats are left out: the metaschema's "regex" format is Python's `re`, which refuses ECMA-262
  classes such as `\\p{L}` that real schemas use (290 of the held-out CloudFormation schemas); patterns are compiled
  below instead. A repeated enum value or required name is let through: it is harmless.
- `enum: []`: no value is valid (the metaschema allows it).
- Patterns (`pattern`, `patternProperties` names) that do not compile with the `regex` module, which the output
  check matches patterns with (UTF-16 surrogate pairs written as escapes read as the one character they make).
- Integer ranges that lie wholly past 64 bits: the backends clamp integer bounds to 64 bits and would write a
  value outside the range.
"""

from __future__ import annotations

import functools
import json

import jsonschema
import regex

from gramserve.grammar.backends.base import GrammarCompileError
from gramserve.grammar.schema_audit import schema_nodes


class SchemaProblem(GrammarCompileError):
    """The schema itself cannot be served, whichever backend compiles it."""


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@functools.lru_cache(maxsize=256)
def schema_problem(schema_text: str) -> str | None:
    """Why the schema (JSON text) cannot be served, or None (also for text that is not JSON: the backends say so)."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return None
    if not isinstance(schema, dict):
        return None
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        errors = [e for e in cls(cls.META_SCHEMA).iter_errors(schema) if e.validator != "uniqueItems"]
    except Exception:  # noqa: BLE001 - a metaschema the validator cannot apply: the backends decide
        errors = []
    if errors:
        error = errors[0]
        return f"the JSON schema is invalid at {_pointer(error.absolute_path)}: {error.message[:300]}"
    for node, path in schema_nodes(schema):
        if node.get("enum") == []:
            return f"the JSON schema at {_pointer(path)} has an empty enum, which no value satisfies"
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for pattern in patterns:
            try:
                regex.compile(_SURROGATE_PAIR.sub(_code_point, pattern))
            except regex.error as exc:
                return f"the JSON schema at {_pointer(path)} has a pattern that does not compile ({exc}): {pattern!r}"
        if _integer_range_past_64_bits(node):
            return f"the JSON schema at {_pointer(path)} asks for an integer range beyond 64-bit integers"
    return None


# ECMA-262 patterns may write a character past U+FFFF as its UTF-16 pair (`\uD800\uDC00`), which the `regex`
# module reads as two surrogates (then a range from the one to the other is out of order).
_SURROGATE_PAIR = regex.compile(r"\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", regex.IGNORECASE)


def _code_point(m: regex.Match) -> str:
    high, low = int(m.group(1), 16), int(m.group(2), 16)
    return f"\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08x}"


def _integer_range_past_64_bits(node: dict) -> bool:
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" not in types or "number" in types:  # a number may be that large
        return False

    def bound(key: str, default: float) -> float | int:
        value = node.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    inf = float("inf")
    low_past = bound("minimum", -inf) > INT64_MAX or bound("exclusiveMinimum", -inf) >= INT64_MAX
    high_past = bound("maximum", inf) < INT64_MIN or bound("exclusiveMaximum", inf) <= INT64_MIN
    return low_past or high_past


def _pointer(path) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)
