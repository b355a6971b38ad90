"""Typing of string-valued parameters (qwen3_coder's XML format) by the tool's JSON Schema."""

from __future__ import annotations

import ast
import json


def schema_types(schema) -> set[str]:
    """The JSON types a schema allows (empty: unknown)."""
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= schema_types(sub)
    for v in schema.get("enum") or ([schema["const"]] if "const" in schema else []):
        types.add(_json_type(v))
    if not types and isinstance(schema.get("properties"), dict):
        types.add("object")
    return types


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def coerce(raw: str, schema) -> object:
    """The value of a parameter written as raw text, typed by its schema.

    Only "string" allowed (or no schema and not JSON): the text itself. Otherwise the first reading
    that fits an allowed type: null, boolean, integer, number, JSON/Python literal object or
    array; failing all, the text."""
    types = schema_types(schema)
    if types == {"string"}:
        return raw
    s = raw.strip()
    if "null" in types and s.lower() in ("null", "none"):
        return None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types:
        try:
            return int(s)
        except ValueError:
            pass
    if "number" in types:
        try:
            f = float(s)
            if f == f and f not in (float("inf"), float("-inf")):
                return int(f) if f.is_integer() and "." not in s and "e" not in s.lower() else f
        except ValueError:
            pass
    if types & {"object", "array"} or not types:
        for load in (json.loads, ast.literal_eval):
            try:
                v = load(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if not types and isinstance(v, (dict, list, int, float, bool)) or isinstance(v, (dict, list)):
                try:
                    json.dumps(v, allow_nan=False)
                except (TypeError, ValueError):
                    continue
                return v
    return raw
