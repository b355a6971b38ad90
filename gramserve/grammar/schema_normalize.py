"""Rewrites of a JSON schema that keep its meaning but let every backend enforce it.

`declare_required`: a name listed in an object's `required` but absent from its `properties` must still
appear in valid output. Backends build objects from `properties` (and, in strict-JSON mode, forbid
undeclared keys), so they would silently drop it. We declare it, with the schema `additionalProperties`
gives undeclared keys (any JSON value by default); when the object forbids undeclared keys the schema cannot
be satisfied, and compiling fails with a clear message instead of producing invalid output.
"""

from __future__ import annotations

import copy
from typing import Any

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
