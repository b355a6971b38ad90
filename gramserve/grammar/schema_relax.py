"""The closest schema a grammar can enforce, for schemas no backend enforces exactly.

Some keywords state relations a token grammar cannot follow (uniqueItems, if/then/else, dependencies, contains,
unevaluated*, most forms of `not`, oneOf whose branches may overlap, lookaround in a pattern). Under `auto`, when
no backend enforces a schema exactly, the service compiles `relax(schema)` instead: those keywords dropped (an
overlapping oneOf becomes anyOf), everything else kept. Every output such a grammar allows is still JSON of the
schema's shape, but may break a dropped keyword, so the server checks each finished output against the original
schema and resamples a failing one (server/output_check.py, server/tokenizer_manager.py).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from gramserve.grammar.backends._structural_tag import tag_schemas
from gramserve.grammar.backends.base import GrammarCompileError
from gramserve.grammar.schema_audit import _oneof_overlaps, beyond_regular
from gramserve.grammar.schema_normalize import hoist_deep_refs, rewrite_not

# Keywords a grammar cannot follow: dropped from the grammar, enforced by the last check.
UNGRAMMATICAL = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicAnchor",
    "$dynamicRef",
)
# Formats llguidance 1.x knows; others are dropped (the last check still checks the ones jsonschema knows).
KNOWN_FORMATS = {
    "date-time",
    "time",
    "date",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uuid",
    "uri",
    "unknown",
}
_INSTANCE_KEYS = {"enum", "const", "default", "examples"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}


def relax(schema: Any) -> tuple[Any, list[str]]:
    """`schema` with what no grammar enforces taken out, and what was taken out (keyword at JSON pointer)."""
    dropped: list[str] = []
    if not isinstance(schema, dict):
        return schema, dropped
    return _relax(copy.deepcopy(schema), "", dropped), dropped


def dropped_keywords(text: str, kind: str = "json_schema") -> list[str]:
    """What `relax` takes out of a JSON schema (after `not` is rewritten where it can be), or out of each JSON schema
    of a structural tag (tool-call arguments); [] if nothing, or if the text cannot be read."""
    try:
        schemas = [json.loads(text)] if kind == "json_schema" else tag_schemas(text) if kind == "structural_tag" else []
    except (ValueError, GrammarCompileError):
        return []
    return [d for schema in schemas for d in relax(rewrite_not(hoist_deep_refs(schema)))[1]]


def relaxable(text: str, kind: str = "json_schema") -> bool:
    return bool(dropped_keywords(text, kind))


def _required_either_way(node: dict) -> list[str]:
    """Properties an if/then/else requires whichever branch applies: those both `then` and `else` require."""
    then, otherwise = node.get("then"), node.get("else")
    if not (isinstance(then, dict) and isinstance(otherwise, dict)):
        return []
    a, b = then.get("required"), otherwise.get("required")
    if not (isinstance(a, list) and isinstance(b, list)):
        return []
    return [k for k in a if isinstance(k, str) and k in b]


def _counts_beside_optional(node: dict) -> bool:
    """minProperties / maxProperties on an object some of whose listed properties are optional."""
    if "minProperties" not in node and "maxProperties" not in node:
        return False
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return bool(props) and any(name not in required for name in props)


def _relax(node: Any, at: str, dropped: list[str]) -> Any:
    if not isinstance(node, dict):
        return node
    if "if" in node:  # what if/then/else implies either way stays in the grammar (a weaker rule, still implied)
        common = _required_either_way(node)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if [k for k in common if k not in required]:
            node["required"] = [*required, *(k for k in common if k not in required)]
    for key in UNGRAMMATICAL:
        if key in node:
            del node[key]
            dropped.append(f"{key} at {at or '/'}")
    if isinstance(node.get("pattern"), str) and beyond_regular(node["pattern"]):
        del node["pattern"]
        dropped.append(f"pattern (lookaround or backreference) at {at or '/'}")
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
        del node["format"]
        dropped.append(f"format {fmt} at {at or '/'}")
    if _counts_beside_optional(node):  # llguidance counts properties only when every listed one is required
        for key in ("minProperties", "maxProperties"):
            if key in node:
                del node[key]
                dropped.append(f"{key} at {at or '/'}")
    if "oneOf" in node and isinstance(node["oneOf"], list) and _oneof_overlaps(node):
        branches = node.pop("oneOf")
        if "anyOf" in node:
            node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]
        else:
            node["anyOf"] = branches
        dropped.append(f"oneOf exclusivity at {at or '/'}")
    for key, value in list(node.items()):
        if key in _INSTANCE_KEYS:
            continue
        here = f"{at}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            node[key] = {k: _relax(v, f"{here}/{k}", dropped) for k, v in value.items()}
        elif isinstance(value, dict):
            node[key] = _relax(value, here, dropped)
        elif isinstance(value, list):
            node[key] = [_relax(v, f"{here}/{i}", dropped) for i, v in enumerate(value)]
    return node
