"""The closest schema a grammar can enforce, for schemas no backend enforces exactly.

Some keywords state relations a token grammar cannot follow (uniqueItems, if/then/else, dependencies, contains,
unevaluated*, most forms of `not`, oneOf whose branches may overlap, lookaround in a pattern). Under `auto`, when
no backend enforces a schema exactly, the service compiles `relax(schema)` instead: those keywords dropped (an
overlapping oneOf becomes anyOf, a pattern loses its lookaround groups), and what llguidance, which compiles
relaxed grammars, cannot read (patterns beyond its regex syntax, asked pattern by pattern); everything else kept.
Every output such a grammar allows is still JSON of the schema's shape, but may break a dropped keyword, so the
server checks each finished output against the original schema and resamples a failing one
(server/output_check.py, server/tokenizer_manager.py).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from typing import Any

from gramserve.grammar.backends._structural_tag import tag_schemas
from gramserve.grammar.backends.base import GrammarCompileError
from gramserve.grammar.schema_audit import _oneof_overlaps, beyond_regular, without_lookaround
from gramserve.grammar.schema_normalize import hoist_deep_refs, rewrite_not

RELAXED = ":relaxed"  # the suffix of the backend name that served a schema relaxed ("llguidance:relaxed")

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
_LENGTHS = ("minLength", "maxLength")
_OBJECT_KEYWORDS = {
    "required",
    "properties",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "propertyNames",
    "title",
    "description",
    "$comment",
}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}


def relax(schema: Any, check_regexes: bool = True) -> tuple[Any, list[str]]:
    """`schema` with what no grammar enforces taken out, and what was taken out (keyword at JSON pointer).
    `check_regexes` False skips asking llguidance about each pattern (about 0.3 ms each: not for the service's loop)."""
    dropped: list[str] = []
    if not isinstance(schema, dict):
        return schema, dropped
    refused = _regex_refused if check_regexes else _never
    return _relax(copy.deepcopy(schema), "", dropped, refused), dropped


def dropped_keywords(text: str, kind: str = "json_schema", check_regexes: bool = True) -> list[str]:
    """What `relax` takes out of a JSON schema (after `not` is rewritten where it can be), or out of each JSON schema
    of a structural tag (tool-call arguments); [] if nothing, or if the text cannot be read."""
    try:
        schemas = [json.loads(text)] if kind == "json_schema" else tag_schemas(text) if kind == "structural_tag" else []
    except (ValueError, GrammarCompileError):
        return []
    return [d for schema in schemas for d in relax(rewrite_not(hoist_deep_refs(schema)), check_regexes)[1]]


def relaxable(text: str, kind: str = "json_schema") -> bool:
    """Might relaxing change the schema? Cheap enough for the grammar service's loop: patterns are not checked one by
    one (a schema with any may have one the grammar cannot read; its relaxed compile finds out, on a worker)."""
    return '"pattern' in text or bool(dropped_keywords(text, kind, check_regexes=False))


def _never(_schema: dict) -> bool:
    return False


def _required_either_way(node: dict) -> list[str]:
    """Properties an if/then/else requires whichever branch applies: those both `then` and `else` require."""
    then, otherwise = node.get("then"), node.get("else")
    if not (isinstance(then, dict) and isinstance(otherwise, dict)):
        return []
    a, b = then.get("required"), otherwise.get("required")
    if not (isinstance(a, list) and isinstance(b, list)):
        return []
    return [k for k in a if isinstance(k, str) and k in b]


def _regex_refused(string_schema: dict) -> bool:
    """Does llguidance, which compiles relaxed grammars, refuse this string (or patternProperties) schema? Its regex
    syntax is Rust's, without lookaround, word boundaries or anchors inside the pattern; it cannot always intersect a
    pattern with a length range ("Unable to determine if regex is empty"), and it wants patternProperties disjoint.
    CloudFormation's schemas hold all of these. Checking one pattern takes about 0.3 ms."""
    return _refused_text(json.dumps(string_schema, sort_keys=True))


@functools.lru_cache(maxsize=8192)
def _refused_text(text: str) -> bool:
    try:
        from llguidance import LLMatcher
    except ImportError:  # no llguidance: nothing to tell (the compile itself reports)
        return False
    try:
        return bool(LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(text)))
    except Exception:  # noqa: BLE001 - a schema its parser rejects outright is refused too
        return True


def _object_only(branch: Any) -> bool:
    """A schema whose keywords all apply to objects only ({"required": ["a"]}, or {}): any non-object passes it."""
    return branch is True or (isinstance(branch, dict) and branch.keys() <= _OBJECT_KEYWORDS)


def _counts_beside_optional(node: dict) -> bool:
    """minProperties / maxProperties on an object some of whose listed properties are optional."""
    if "minProperties" not in node and "maxProperties" not in node:
        return False
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return bool(props) and any(name not in required for name in props)


def _relax_pattern(node: dict, at: str, dropped: list[str], refused: Callable[[dict], bool]) -> None:
    """A pattern with lookaround keeps the rest of it; one the grammar's regex engine cannot read goes; one it cannot
    intersect with the string's length range keeps the pattern and loses the range."""
    pattern = node.get("pattern")
    if isinstance(pattern, str) and beyond_regular(pattern):
        regular = without_lookaround(pattern)
        if regular is not None and not refused({"type": "string", "pattern": regular}):
            node["pattern"] = pattern = regular  # the lookaround goes to the check, the rest stays in the grammar
            dropped.append(f"lookaround in the pattern at {at}")
        else:
            del node["pattern"]
            dropped.append(f"pattern (lookaround or backreference) at {at}")
    if isinstance(pattern, str) and "pattern" in node:
        if refused({"type": "string", "pattern": pattern}):
            del node["pattern"]
            dropped.append(f"pattern (beyond the grammar's regex syntax) at {at}")
        elif refused({"type": "string", **{k: node[k] for k in ("pattern", *_LENGTHS) if k in node}}):
            for key in _LENGTHS:
                if key in node:
                    del node[key]
                    dropped.append(f"{key} beside pattern at {at}")


def _relax_pattern_properties(node: dict, at: str, dropped: list[str], refused: Callable[[dict], bool]) -> None:
    """patternProperties keys lose their lookaround, or go when unreadable; overlapping keys: the first stays."""
    for key in list(node["patternProperties"]):
        regular = without_lookaround(key) if beyond_regular(key) else key
        if regular is None or refused({"type": "string", "pattern": regular}):
            del node["patternProperties"][key]
            dropped.append(f"patternProperties {key!r} at {at}")
        elif regular != key and regular not in node["patternProperties"]:
            node["patternProperties"] = {(regular if k == key else k): v for k, v in node["patternProperties"].items()}
            dropped.append(f"lookaround in patternProperties {key!r} at {at}")
        elif regular != key:
            del node["patternProperties"][key]
            dropped.append(f"patternProperties {key!r} at {at}")
    keys = list(node["patternProperties"])
    if len(keys) > 1 and refused({"type": "object", "patternProperties": {k: {} for k in keys}}):
        for key in keys[1:]:  # llguidance wants the patterns disjoint: the first stays, the check does the rest
            del node["patternProperties"][key]
            dropped.append(f"patternProperties {key!r} (overlapping) at {at}")


def _relax(node: Any, at: str, dropped: list[str], refused: Callable[[dict], bool]) -> Any:
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
    _relax_pattern(node, at or "/", dropped, refused)
    if isinstance(node.get("patternProperties"), dict):
        _relax_pattern_properties(node, at or "/", dropped, refused)
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
        if "type" not in node and sum(_object_only(b) for b in branches) >= 2:
            # a non-object passes every such branch, so it fails oneOf: the instance is an object (exact, not relaxed)
            node["type"] = "object"
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
            node[key] = {k: _relax(v, f"{here}/{k}", dropped, refused) for k, v in value.items()}
        elif isinstance(value, dict):
            node[key] = _relax(value, here, dropped, refused)
        elif isinstance(value, list):
            node[key] = [_relax(v, f"{here}/{i}", dropped, refused) for i, v in enumerate(value)]
    return node
