"""Rewrites of a JSON schema that keep its meaning but let every backend enforce it.

`declare_required`: a name listed in an object's `required` but absent from its `properties` must still
appear in valid output. Backends build objects from `properties` (and, in strict-JSON mode, forbid
undeclared keys), so they would silently drop it. We declare it, with the schema `additionalProperties`
gives undeclared keys (any JSON value by default); when the object forbids undeclared keys the schema cannot
be satisfied, and compiling fails with a clear message instead of producing invalid output.
"""

from __future__ import annotations

import copy
import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from typing import Any
from urllib.parse import unquote

from gramserve.grammar.backends.base import GrammarCompileError
from gramserve.grammar.schema_audit import _subschemas

# "Any JSON value", spelled out: outlines-core turns an empty schema {} into a pattern that matches nothing.
ANY_VALUE = {"type": ["string", "number", "boolean", "null", "object", "array"]}


def declare_required(schema: Any) -> Any:
    """A copy of `schema` in which every required property is declared in `properties`."""
    if not isinstance(schema, dict):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        required = node.get("required")
        if not isinstance(required, list) or "patternProperties" in node:
            continue
        props = node.get("properties")
        if props is None and node.get("type") not in ("object", ["object"]):
            continue  # e.g. a bare {"required": [...]} branch of allOf / anyOf: its siblings declare them
        props = props if isinstance(props, dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in props]
        if not missing:
            continue
        extra = node.get("additionalProperties", True)
        if extra is False:
            raise GrammarCompileError(
                f"json_schema: required properties {missing} are not declared and "
                "additionalProperties is false, so no object can satisfy the schema"
            )
        node["properties"] = {
            **props,
            **{name: (dict(ANY_VALUE) if extra is True or extra == {} else extra) for name in missing},
        }
    return out


def close_objects(schema: Any) -> Any:
    """Strict JSON (``GrammarOptions.strict_json``) for backends without such a mode: a copy in which every object
    schema that declares `properties` but says nothing of other keys (no additionalProperties, patternProperties,
    unevaluatedProperties) gets ``additionalProperties: false``, as xgrammar's strict mode treats it. A schema with
    allOf anywhere is left open: a branch closed on its own properties would forbid its siblings' properties."""
    if not isinstance(schema, dict) or any("allOf" in node for node in _subschemas(schema)):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        props = node.get("properties")
        if isinstance(props, dict) and props and not _OPEN_KEYS.intersection(node):
            node["additionalProperties"] = False
    return out


_OPEN_KEYS = {"additionalProperties", "patternProperties", "unevaluatedProperties"}


_ALL_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_ANNOTATIONS = {"description", "title", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly"}
_INSTANCE_KEYS = {"enum", "const", "default", "examples"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def rewrite_not(schema: Any) -> Any:
    """A copy of `schema` in which the forms of `not` that a grammar can state positively are so stated, exactly:

    * ``not: {}`` (nothing validates) -> ``false``; ``not: false`` -> dropped;
    * ``not: {type: T}`` -> ``type``: the other types (``integer`` goes with ``number``);
    * ``not: {required: [a]}`` -> ``properties: {a: false}`` (a must be absent); ``not: {required: [a, b, ...]}``
      -> ``anyOf`` of "a absent", "b absent", ... (when the node has no anyOf of its own).

    Other forms stay as they are (the backends refuse them)."""
    if not isinstance(schema, dict) or not any("not" in node for node in _subschemas(schema)):
        return schema
    return _rewrite(copy.deepcopy(schema))


def _rewrite(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    for key, value in node.items():
        if key in _INSTANCE_KEYS:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            node[key] = {k: _rewrite(v) for k, v in value.items()}
        elif isinstance(value, dict):
            node[key] = _rewrite(value)
        elif isinstance(value, list):
            node[key] = [_rewrite(v) for v in value]
    if "not" not in node:
        return node
    neg = node["not"]
    if neg is False:
        del node["not"]
        return node
    if neg is True or (isinstance(neg, dict) and not set(neg) - _ANNOTATIONS):
        return False
    if not isinstance(neg, dict):
        return node
    keys = set(neg) - _ANNOTATIONS
    if keys == {"type"}:
        excluded = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"])
        if "number" in excluded:
            excluded.add("integer")
        own = node.get("type", list(_ALL_TYPES))
        own = [own] if isinstance(own, str) else list(own)
        if "integer" in excluded and "number" in own and "number" not in excluded:
            return node  # "a number but not an integer": no type says that
        allowed = [t for t in own if t not in excluded]
        if not allowed:
            return False
        node["type"] = allowed if len(allowed) > 1 else allowed[0]
        del node["not"]
    elif keys == {"required"} and isinstance(neg["required"], list) and neg["required"]:
        names = [n for n in neg["required"] if isinstance(n, str)]
        if len(names) != len(neg["required"]):
            return node
        if len(names) == 1:
            if names[0] in (node.get("required") or []):
                return False
            props = node.get("properties")
            node["properties"] = {**(props if isinstance(props, dict) else {}), names[0]: False}
            del node["not"]
        elif "anyOf" not in node:
            node["anyOf"] = [{"properties": {name: False}} for name in names]
            del node["not"]
    return node


_STRING_SHAPES = {"maxLength", "pattern", "format", "enum", "const"}


def bound_unbounded(schema: Any, max_length: int | None, max_items: int | None) -> Any:
    """A copy of `schema` in which strings without maxLength (nor pattern / format / enum / const) get
    ``maxLength: max(max_length, minLength)`` and arrays without maxItems get ``maxItems: max(max_items, minItems,
    prefixItems)``: a subset of the schema's language, so every output is still valid. Opt-in
    (``--grammar-max-string-length``, ``--grammar-max-array-items``) against outputs that loop to max_tokens."""
    if not isinstance(schema, dict) or (max_length is None and max_items is None):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        types = node.get("type")
        types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        if max_length is not None and "string" in types and not _STRING_SHAPES & node.keys():
            low = node.get("minLength", 0)
            node["maxLength"] = max(max_length, low if isinstance(low, int) else 0)
        if max_items is not None and "array" in types and "maxItems" not in node:
            low = node.get("minItems", 0)
            prefix = node.get("prefixItems")
            floor = max(low if isinstance(low, int) else 0, len(prefix) if isinstance(prefix, list) else 0)
            node["maxItems"] = max(max_items, floor)
    return out


def anchor_patterns(schema: Any) -> Any:
    r"""A copy of `schema` in which a string `pattern` with no anchor at either end must match from the string's
    start (``P`` -> ``^(?:P)``): for backends that search for the pattern anywhere, as the spec says. Without this
    a model writes junk until it happens on the pattern, or never does (``"1234567890000.0.0.0.1234..."`` for an
    unanchored UUID pattern ran to max_tokens). Every string that matches from its start also contains a match: a
    subset of the schema's language, so outputs stay valid. Left alone: patterns that end with ``$`` (``\.json$``
    would become the string ".json"), that start with inline flags, and schemas with allOf (two patterns on one
    string, each anchored, might admit nothing)."""
    if not isinstance(schema, dict):
        return schema
    nodes = list(_subschemas(schema))
    if not any(_unanchored(node.get("pattern")) for node in nodes) or any("allOf" in node for node in nodes):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        if _unanchored(pattern := node.get("pattern")):
            node["pattern"] = f"^(?:{pattern})"
    return out


def _unanchored(pattern: Any) -> bool:
    return (
        isinstance(pattern, str)
        and pattern != ""
        and not pattern.startswith(("^", "(?", "\\A"))
        and not pattern.endswith("$")
    )


# String formats as the last check (jsonschema's format checker) accepts them, written as regexes.
# Dates and times (RFC 3339): the days of each month, February 29 in leap years only (a multiple of 4, of 400 for
# whole centuries), years 0001-9999, seconds 00-59 (the checker refuses the leap second 60), at most six fraction
# digits, upper-case T and Z; 300,000 random strings found none that matches and fails the check.
_YEAR = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
_BY_FOUR = r"(?:0[48]|[2468][048]|[13579][26])"
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
    rf"|02-(?:0[1-9]|1\d|2[0-8]))|(?:\d\d{_BY_FOUR}|{_BY_FOUR}00)-02-29)"
)
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6}){0,1}(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
# IPv4 without leading zeros (the checker's ipaddress refuses "06"); host names of at most 4 labels of 1-62 letters,
# digits and inner hyphens (at most 251 characters: the checker's limits are 63 a label and 253 in all).
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]\d|\d)"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,60}[A-Za-z0-9]){0,1}"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
    "hostname": rf"^{_LABEL}(?:\.{_LABEL}){{0,3}}$",
}


def format_patterns(schema: Any) -> Any:
    """A copy of `schema` in which a string `format` of FORMAT_PATTERNS (with no `pattern` of its own) is written as
    its pattern: a subset of the format that the last check always accepts. The backends' own formats let through
    values it refuses: the second 60 at any hour (llguidance and xgrammar), February 29 of any year (both), April
    31 and February 30 (xgrammar), the year 0000, IPv4 octets with leading zeros (xgrammar), host name labels past
    63 characters (both). `schema` itself when no node has such a format."""
    if not isinstance(schema, dict) or not any(_patterned_format(node) for node in _subschemas(schema)):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        if _patterned_format(node):
            node["pattern"] = FORMAT_PATTERNS[node.pop("format")]
    return out


def _patterned_format(node: dict) -> bool:
    types = node.get("type", "string")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    return node.get("format") in FORMAT_PATTERNS and "pattern" not in node and is_string


# Keywords whose value JSON Schema requires to be a non-negative integer; 2.0 is one (a number with a zero fraction).
INTEGER_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)


def integral_counts(schema: Any) -> Any:
    """A copy of `schema` in which counts written as floats (``"maxLength": 2.0``) are ints; `schema` itself when
    there are none. xgrammar ignored a float maxLength and let a 287-token string through (a GPU run over the
    JSON-Schema-Test-Suite); other backends may refuse it."""
    if not isinstance(schema, dict):
        return schema
    found = [
        node
        for node in _subschemas(schema)
        if any(isinstance(node.get(k), float) and node[k].is_integer() for k in INTEGER_KEYWORDS)
    ]
    if not found:
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        for k in INTEGER_KEYWORDS:
            if isinstance(node.get(k), float) and node[k].is_integer():
                node[k] = int(node[k])
    return out


def aligned_multiple_bounds(schema: Any) -> Any:
    """A copy of `schema` in which a node with `multipleOf` has its numeric bounds moved to the nearest multiples
    inside them (`minimum` 0.495, `maximum` 0.505, `multipleOf` 0.01 -> 0.5 and 0.5; exclusive bounds become
    inclusive ones): the same values. llguidance 1.9.1 lost the multiples of a range whose bounds are not multiples
    (it allowed nothing for 0.5..0.5051 by 0.01, and only 0.49 for 0.49..0.505). `schema` itself when no node needs
    it. Bounds are computed as decimals from the numbers' shortest text; a range with no multiple is left as it is
    (the backends refuse it)."""
    if not isinstance(schema, dict):
        return schema
    if not any(_aligned(node) for node in _subschemas(schema)):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        if (bounds := _aligned(node)) is not None:
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                node.pop(key, None)
            lo, hi = bounds
            if lo is not None:
                node["minimum"] = lo
            if hi is not None:
                node["maximum"] = hi
    return out


def _aligned(node: dict) -> tuple[int | float | None, int | float | None] | None:
    """The inclusive (minimum, maximum) on multiples of the node's `multipleOf`, if that differs from its bounds."""
    step = node.get("multipleOf")
    if not _is_number(step) or step <= 0 or isinstance(node.get("exclusiveMinimum"), bool):
        return None  # draft 4's boolean exclusive bounds: left alone
    if isinstance(node.get("exclusiveMaximum"), bool):
        return None
    step_d = Decimal(repr(step))
    los = [(node[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if _is_number(node.get(k))]
    his = [(node[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))]
    if not los and not his:
        return None
    try:
        lo = max((_first_multiple(Decimal(repr(v)), step_d, strict, up=True) for v, strict in los), default=None)
        hi = min((_first_multiple(Decimal(repr(v)), step_d, strict, up=False) for v, strict in his), default=None)
    except (ArithmeticError, ValueError):
        return None
    if lo is not None and hi is not None and lo > hi:
        return None  # no multiple in the range
    as_number = [None if b is None else _as_json_number(b) for b in (lo, hi)]
    same = [node.get("minimum"), node.get("maximum")] == as_number and not (
        "exclusiveMinimum" in node or "exclusiveMaximum" in node
    )
    return None if same else (as_number[0], as_number[1])


def _first_multiple(bound: Decimal, step: Decimal, strict: bool, up: bool) -> Decimal:
    """The first multiple of `step` at or past `bound` (past it for a strict bound), going up or down."""
    with localcontext() as exact:
        exact.prec = 1000  # the quotient's digits all count (28, the default, rounds long bounds onto a multiple)
        k = bound / step
        whole = k.to_integral_value(rounding=ROUND_CEILING if up else ROUND_FLOOR)
        if strict and whole == k:
            whole += 1 if up else -1
        return whole * step


def _as_json_number(value: Decimal) -> int | float:
    return int(value) if value == value.to_integral_value() else float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Keywords the rewrites of this module and schema_relax.py rename or drop: a $ref whose JSON pointer passes through
# one of them would point at nothing afterwards.
_REWRITTEN_KEYS = frozenset(
    {"not", "oneOf", "if", "then", "else", "dependencies", "dependentSchemas", "contains", "propertyNames"}
    | {"unevaluatedProperties", "unevaluatedItems"}
)
HOISTED_PREFIX = "gramserve_ref_"


def pointer_parts(ref: str) -> list[str] | None:
    """The unescaped segments of a local JSON-pointer reference (``#/a/b~1c`` -> [a, b/c]; ``#`` -> []), or None."""
    if ref == "#":
        return []
    if not ref.startswith("#/"):
        return None
    return [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]


def resolve_ref(schema: Any, ref: str) -> Any:
    """What a local `$ref` ("#", "#/a/b") points at in `schema`; None where it leads nowhere or is not local."""
    parts = pointer_parts(ref)
    return None if parts is None else _resolve(schema, parts)


def _resolve(schema: Any, parts: list[str]) -> Any:
    node = schema
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def hoist_deep_refs(schema: Any) -> Any:
    """A copy of `schema` in which each ``$ref`` whose pointer goes through a keyword that a later rewrite renames
    or drops (``#/definitions/step/oneOf/1/properties/run``: an overlapping oneOf becomes anyOf when relaxed)
    points instead at a copy of its target under ``$defs``; `schema` itself when there is none. The copies are
    taken before any rewrite, so the meaning is unchanged. (SchemaStore's CircleCI schema was refused for this.)"""
    if not isinstance(schema, dict):
        return schema
    targets: dict[str, str] = {}
    for node in _subschemas(schema):
        ref = node.get("$ref")
        parts = pointer_parts(ref) if isinstance(ref, str) and ref != "#" else None
        if parts and _REWRITTEN_KEYS.intersection(parts) and ref not in targets:
            if isinstance(_resolve(schema, parts), (dict, bool)):
                targets[ref] = f"{HOISTED_PREFIX}{len(targets)}"
    if not targets:
        return schema
    out = copy.deepcopy(schema)
    defs = out.get("$defs") if isinstance(out.get("$defs"), dict) else {}
    for ref, name in targets.items():
        defs[name] = copy.deepcopy(_resolve(schema, pointer_parts(ref)))
    out["$defs"] = defs
    for node in _subschemas(out):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in targets:
            node["$ref"] = f"#/$defs/{targets[ref]}"
    return out


# Keywords that constrain an instance (or locate schemas); any other key of a schema object is an annotation
# (description, title, default, examples, markdownDescription, x-...), which validation ignores.
_CONSTRAINING = frozenset(
    "$ref $defs definitions $id $schema $anchor $dynamicRef $dynamicAnchor type enum const properties"
    " patternProperties additionalProperties required items prefixItems additionalItems contains minContains"
    " maxContains minItems maxItems uniqueItems minLength maxLength pattern format minimum maximum exclusiveMinimum"
    " exclusiveMaximum multipleOf minProperties maxProperties propertyNames dependentRequired dependentSchemas"
    " dependencies allOf anyOf oneOf not if then else unevaluatedProperties unevaluatedItems".split()
)


def drop_ref_annotations(schema: Any) -> Any:
    """A copy of `schema` without the annotations beside each ``$ref`` (``{"$ref": "#/definitions/logic",
    "markdownDescription": ...}``); `schema` itself when there are none. llguidance refuses a recursive reference
    that has sibling keys, and annotations change nothing a grammar or a validator does. (SchemaStore's CircleCI
    schema was refused for this.)"""
    if not isinstance(schema, dict):
        return schema

    def annotated(node: dict) -> bool:
        return "$ref" in node and any(key not in _CONSTRAINING for key in node)

    if not any(annotated(node) for node in _subschemas(schema)):
        return schema
    out = copy.deepcopy(schema)
    for node in _subschemas(out):
        if annotated(node):
            for key in [k for k in node if k not in _CONSTRAINING]:
                del node[key]
    return out
