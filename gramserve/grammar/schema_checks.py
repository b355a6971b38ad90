"""Checks of a JSON schema that no backend can serve correctly, run with its compile (off the request path: the
metaschema check of a large schema takes tens of ms): the request gets a 400 that says where, instead of a compile
that goes through and outputs that cannot validate (or cannot be checked).

- The schema against its draft's metaschema, for structure only (`"required": "a"`, `"multipleOf": -3`,
  `"type": []`). Formats are left out: the metaschema's "regex" format is Python's `re`, which refuses ECMA-262
  classes such as `\\p{L}` that real schemas use (290 of the held-out CloudFormation schemas); patterns are compiled
  below instead. A repeated enum value or required name is let through: it is harmless.
- Nodes no value satisfies that the metaschema allows: `enum: []`, an enum or const with no value of the node's
  `type`, a `$ref` whose chain of references (each a `$ref` alone) comes back to itself (`{"$ref": "#"}`): a backend
  compiles those into a grammar that stops at its first token or allows nothing but the end.
- Patterns (`pattern`, `patternProperties` names) that do not compile with the `regex` module, which the output
  check matches patterns with (UTF-16 surrogate pairs written as escapes read as the one character they make).
- A necessary unique array with more `minItems` than its items have values (three unique integers in 0..1).
- Integer ranges that lie wholly past 64 bits: the backends clamp integer bounds to 64 bits and would write a
  value outside the range.
"""

from __future__ import annotations

import functools
import json

import jsonschema
import jsonschema_rs
import regex

from gramserve.grammar import pattern_dialect
from gramserve.grammar.backends.base import GrammarCompileError
from gramserve.grammar.schema_audit import TYPE_CHECKS, schema_nodes
from gramserve.grammar.schema_normalize import pointer_parts, resolve_ref
from gramserve.grammar.unique_arrays import closed_set


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
    if error := _metaschema_error(schema):
        return error
    for node, path in schema_nodes(schema):
        if node.get("enum") == []:
            return f"the JSON schema at {_pointer(path)} has an empty enum, which no value satisfies"
        for pattern in pattern_dialect.node_patterns(node):
            if why := pattern_dialect.problem(pattern):
                return f"the JSON schema at {_pointer(path)} has a pattern with {why}: {pattern!r}"
            try:
                regex.compile(_SURROGATE_PAIR.sub(_code_point, pattern_dialect.for_backends(pattern)))
            except regex.error as exc:
                return f"the JSON schema at {_pointer(path)} has a pattern that does not compile ({exc}): {pattern!r}"
        if _integer_range_past_64_bits(node):
            return f"the JSON schema at {_pointer(path)} asks for an integer range beyond 64-bit integers"
    # A nested `$id` starts a new base for the `$ref`s under it, which `resolve_ref` does not follow: those
    # schemas skip the checks below.
    if any("$id" in node for node, path in schema_nodes(schema) if path):
        return None
    for node, path in _necessary_nodes(schema):
        if _no_value_of_its_type(node):
            which = "enum values" if "enum" in node else "const value"
            where = _pointer(path)
            return f"the JSON schema at {where} has no {which} of its type {node['type']!r}: no value satisfies it"
        if (short := _unique_items_short(schema, node)) is not None:
            return (
                f"the JSON schema at {_pointer(path)} asks for at least {node['minItems']} unique items drawn from "
                f"{short} possible values: no value satisfies it"
            )
        if _refers_only_to_itself(schema, node):
            return (
                f"the JSON schema at {_pointer(path)} only refers to itself ($ref {node['$ref'][:80]!r}, in a cycle of "
                "references with nothing else): no value satisfies it"
            )
    return None


# The drafts whose metaschemas jsonschema-rs bundles, as `$schema` names them (with or without the empty fragment).
# Under any other `$schema` it would fetch the metaschema over the network.
_BUNDLED_METASCHEMAS = frozenset(
    uri + end
    for uri in (
        "http://json-schema.org/draft-04/schema",
        "http://json-schema.org/draft-06/schema",
        "http://json-schema.org/draft-07/schema",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    )
    for end in ("", "#")
)


def _metaschema_error(schema: dict) -> str | None:
    """The schema's first error against its draft's metaschema, or None.

    jsonschema-rs answers first (0.02-0.3 ms): Python's jsonschema takes 1-35 ms a schema (its `$dynamicRef`
    lookups), more than llguidance's whole compile, and a new schema's first token waited for it. Python's validator
    runs only when jsonschema-rs finds an error, for the message and to let a repeated enum value or required name
    through (a `uniqueItems` error), and for drafts jsonschema-rs does not bundle (draft 3, unknown `$schema`)."""
    uri = schema.get("$schema", "https://json-schema.org/draft/2020-12/schema")  # both validators' default
    if isinstance(uri, str) and uri in _BUNDLED_METASCHEMAS:
        try:
            if jsonschema_rs.meta.is_valid(schema):
                return None
        except Exception:  # noqa: BLE001 - Python's validator decides
            pass
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        errors = [e for e in cls(cls.META_SCHEMA).iter_errors(schema) if e.validator != "uniqueItems"]
    except Exception:  # noqa: BLE001 - a metaschema the validator cannot apply: the backends decide
        errors = []
    if errors:
        error = errors[0]
        return f"the JSON schema is invalid at {_pointer(error.absolute_path)}: {error.message[:300]}"
    return None


def _necessary_nodes(schema: dict):
    """The schema nodes every valid value must satisfy: the root, and from a necessary node its `$ref`'s target,
    its `allOf` members, its required properties, and the items an array must have (`minItems`). A node no value
    satisfies elsewhere (an optional property, an anyOf branch) leaves the schema satisfiable (real schemas have
    such properties: the value just never has them)."""
    seen: set[int] = set()
    stack = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, path
        ref = node.get("$ref")
        if isinstance(ref, str):
            stack.append((resolve_ref(schema, ref), tuple(pointer_parts(ref) or ())))
        if isinstance(node.get("allOf"), list):
            stack.extend((sub, (*path, "allOf", i)) for i, sub in enumerate(node["allOf"]))
        # `required` and `minItems` bind only values of their type: an untyped node, or one that may be null, has
        # values without those members or items.
        props, required = node.get("properties"), node.get("required")
        if _only_type(node, "object") and isinstance(props, dict) and isinstance(required, list):
            stack.extend((props[k], (*path, "properties", k)) for k in required if isinstance(k, str) and k in props)
        min_items = node.get("minItems")
        if _only_type(node, "array") and isinstance(min_items, int) and not isinstance(min_items, bool) and min_items:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            stack.extend((sub, (*path, "prefixItems", i)) for i, sub in enumerate(prefix[:min_items]))
            if min_items > len(prefix) and isinstance(node.get("items"), dict):
                stack.append((node["items"], (*path, "items")))


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


# An integral float (1.0) is an integer in JSON Schema: the strict check is the audit's concern (xgrammar writes
# the literal it was given).
_TYPE_OF = {**TYPE_CHECKS, "integer": lambda v: TYPE_CHECKS["integer"](v) or (isinstance(v, float) and v.is_integer())}


def _no_value_of_its_type(node: dict) -> bool:
    """An enum or const none of whose values has the node's type (`{"type": "string", "enum": [1, 2]}`)."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or not all(t in _TYPE_OF for t in types):
        return False
    if "enum" in node and isinstance(node["enum"], list):
        values = node["enum"]
    elif "const" in node:
        values = [node["const"]]
    else:
        return False
    return bool(values) and not any(_TYPE_OF[t](v) for v in values for t in types)


# Keywords that say nothing about the value: a node with only these beside `$ref` is its reference's schema.
_ANNOTATIONS = {"$ref", "$comment", "$id", "$schema", "$anchor", "title", "description", "default", "examples",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly"}  # fmt: skip


def _refers_only_to_itself(root: dict, node: dict) -> bool:
    """The node is a `$ref` alone whose chain of local references, each a `$ref` alone, comes back to itself
    (`{"$ref": "#"}` at the root, or a -> b -> a): a schema with no value, on which a backend either stops or
    writes nothing it can end."""
    seen: set[int] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node.keys() <= _ANNOTATIONS:
        if id(node) in seen:
            return True
        seen.add(id(node))
        node = resolve_ref(root, node["$ref"])
    return False


def _unique_items_short(root: dict, node: dict) -> int | None:
    """For a unique array with more `minItems` than its items have values (`uniqueItems`, three integers in 0..1),
    how many values there are; else None. Items with a `$ref` are left alone (`closed_set` may read them narrower
    than a draft does)."""
    min_items, items = node.get("minItems"), node.get("items")
    if not (_only_type(node, "array") and node.get("uniqueItems") is True and isinstance(items, dict)):
        return None
    if isinstance(min_items, bool) or not isinstance(min_items, int) or "prefixItems" in node:
        return None
    if "$ref" in json.dumps(items):
        return None
    values = closed_set(root, items)
    return len(values) if values is not None and len(values) < min_items else None


def _only_type(node: dict, name: str) -> bool:
    return node.get("type") in (name, [name])


def _pointer(path) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)
