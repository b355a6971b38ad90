"""Which JSON Schema constructs a backend would silently not enforce.

A backend that ignores a keyword still compiles the schema, and the output may then violate it. To keep
"valid by construction", the GrammarService treats such a schema as rejected by that backend: with `auto`
the next backend serves it; with an explicit backend the request gets a 400 naming the keyword.
The lists come from probing each backend with valid and invalid instances (see the backend modules).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema

# xgrammar 0.2.8 compiles these but does not enforce them (oneOf is treated as anyOf).
XGRAMMAR_UNENFORCED = {
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
}

# outlines-core 0.2.14 compiles these into its regex without enforcing them (if/then/else, dependentSchemas,
# minContains and minProperties: probed 2026-11-25 after a GPU run gave an output missing a required property of an
# if/then/else schema).
OUTLINES_UNENFORCED = {
    "allOf",  # concatenated: an allOf of two enums of arrays gave `[5][5]`
    "multipleOf",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "minProperties",
    "maxProperties",
}
# The string formats xgrammar 0.2.8 enforces; any other (iri, idn-email, idn-hostname, iri-reference, regex, an
# unknown name) it compiles as any string (probed 2026-11-28: each format against a string with spaces and braces).
# Those the last check holds outputs to are unenforced (`_format_unenforced_by_xgrammar`).
XGRAMMAR_FORMATS = {
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "uri-template",
    "uuid",
    "json-pointer",
    "relative-json-pointer",
}
_CHECKED_FORMATS = frozenset(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
_NUMERIC_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_LENGTH_BOUNDS = {"minLength", "maxLength"}

TYPE_CHECKS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def schema_nodes(schema: Any) -> Iterator[tuple[dict, tuple]]:
    """Every schema object inside `schema`, with its path of keys and indexes from the root (iterative, so deep
    schemas cannot overflow the stack)."""
    stack = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            yield node, path
            for key, value in node.items():
                if key in ("enum", "const", "default", "examples"):
                    continue  # instance data, not schemas
                if isinstance(value, dict):
                    if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                        stack.extend(((v, (*path, key, k)) for k, v in value.items() if isinstance(v, dict)))
                    else:
                        stack.append((value, (*path, key)))
                elif isinstance(value, list):
                    stack.extend(((v, (*path, key, i)) for i, v in enumerate(value) if isinstance(v, dict)))


def _subschemas(schema: Any) -> Iterator[dict]:
    """Every schema object inside `schema` (`schema_nodes` without the paths)."""
    return (node for node, _ in schema_nodes(schema))


def _enum_type_conflict(node: dict) -> bool:
    types = node.get("type")
    if types is None or not ("enum" in node or "const" in node):
        return False
    types = [types] if isinstance(types, str) else list(types)
    values = node["enum"] if "enum" in node else [node["const"]]
    ok = lambda v: any(TYPE_CHECKS.get(t, lambda _: True)(v) for t in types)  # noqa: E731
    return not all(ok(v) for v in values)


def _discriminators(branch: dict) -> dict[str, set]:
    """Required properties whose value the branch pins to a const / enum: property -> allowed values."""
    out = {}
    props = branch.get("properties") or {}
    for name in branch.get("required") or []:
        p = props.get(name)
        if isinstance(p, dict) and ("const" in p or "enum" in p):
            values = [p["const"]] if "const" in p else p["enum"]
            out[name] = {json.dumps(v, sort_keys=True) for v in values}
    return out


def _types(branch: dict) -> set[str] | None:
    t = branch.get("type")
    if t is None:
        return None
    types = {t} if isinstance(t, str) else set(t)
    return types | {"number"} if "integer" in types else types


def _disjoint(a: dict, b: dict) -> bool:
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not (ta & tb):
        return True
    da, db = _discriminators(a), _discriminators(b)
    return any(not (da[k] & db[k]) for k in da.keys() & db.keys())


def _oneof_overlaps(node: dict) -> bool:
    branches = [b for b in node.get("oneOf") or [] if isinstance(b, dict)]
    if any("$ref" in b for b in branches):
        return True  # cannot tell without resolving references: assume they may overlap
    return any(not _disjoint(a, b) for i, a in enumerate(branches) for b in branches[i + 1 :])


_ASSERTIONS = {
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "const",
    "minimum",
    "maximum",
    "pattern",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "additionalProperties",
}


def unenforced(backend: str, schema_text: str) -> list[str]:
    """Constructs in the schema that `backend` would not enforce; empty when it enforces them all."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return []  # the backend reports the syntax error itself
    found: set[str] = set()
    for node in _subschemas(schema):
        # Every backend treats oneOf as anyOf: only branches that exclude each other are safe.
        if "oneOf" in node and _oneof_overlaps(node):
            found.add("oneOf with branches that may overlap")
        if backend == "outlines":
            found |= OUTLINES_UNENFORCED & node.keys()
            if node.get("uniqueItems") is True:
                found.add("uniqueItems")
            if ("pattern" in node or "format" in node) and node.keys() & _LENGTH_BOUNDS:
                found.add("minLength/maxLength next to pattern or format")  # walks left the pattern entirely
            if node.keys() & _NUMERIC_BOUNDS:  # integers and numbers alike (a number with minimum 5 took 4)
                found.add("numeric bounds")
            if ("anyOf" in node or "oneOf" in node) and _ASSERTIONS & node.keys():
                found.add("anyOf/oneOf next to other keywords")
        if backend == "llguidance" and _integer_bound_past_float(node):
            # llguidance 1.9.1 reads bounds as doubles: maximum 9007199254740999 let 9007199254741000 through
            found.add("integer bounds past 2**53")
        if backend == "llguidance" and _exclusive_whole_bound_within_one(node):
            found.add("a number range within 1 of a whole exclusive bound")
        if backend != "xgrammar":
            continue  # llguidance rejects at compile time what it cannot enforce
        found |= XGRAMMAR_UNENFORCED & node.keys()
        if _format_unenforced_by_xgrammar(node):
            found.add(f"format {node['format'][:40]!r}")
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        if _enum_type_conflict(node):
            found.add("enum/const values outside the declared type")
        # xgrammar 0.2.9 logs "multipleOf is not supported for type:number; ignoring multipleOf" (integers keep it).
        if "multipleOf" in node and node.get("type") not in ("integer", ["integer"]):
            found.add("multipleOf on numbers")
        if ("anyOf" in node or "oneOf" in node) and _ASSERTIONS & node.keys():
            found.add("anyOf/oneOf next to other keywords")
        # xgrammar 0.2.8 warns "pattern combined with minLength/maxLength is not supported" and drops the lengths
        # (a pattern with minLength 10000 gave 8 characters); format strings lose them the same way, silently.
        if ("pattern" in node or "format" in node) and node.keys() & _LENGTH_BOUNDS:
            found.add("minLength/maxLength next to pattern or format")
        if isinstance(node.get("pattern"), str) and beyond_regular(node["pattern"]):
            found.add("lookaround or backreferences in a pattern")
        # References are never fetched; xgrammar compiles one it cannot resolve as "any JSON value".
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            found.add(f"a $ref outside the schema ({ref[:80]})")
        elif isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):  # an anchor name: "any JSON" too
            found.add(f"a $ref to an anchor ({ref[:80]})")
    return sorted(found)


def _integer_bound_past_float(node: dict) -> bool:
    """An integer node bounded past 2**53, where a double no longer holds every integer."""
    if node.get("type") not in ("integer", ["integer"]):
        return False
    bounds = (node.get(k) for k in _NUMERIC_BOUNDS)
    return any(isinstance(b, (int, float)) and not isinstance(b, bool) and abs(b) > 2**53 for b in bounds)


def _exclusive_whole_bound_within_one(node: dict) -> bool:
    """A number range with a whole exclusive bound and its other bound less than 1 away. llguidance 1.9.1 let the
    bound itself through when it is the end nearer zero: exclusiveMinimum 0 with exclusiveMaximum 0.001 (or
    maximum 0.5) gave 0, exclusiveMinimum 100 with maximum 100.9 gave 100, minimum -5.5 with exclusiveMaximum -5
    gave -5, and (-0.001, 0) gave -0; xgrammar keeps them out. Flagged at either end, and at a distance of exactly
    1, to be safe. Integer-only nodes are not affected."""
    if node.get("type") in ("integer", ["integer"]):
        return False
    lo = _bound(node, "minimum"), _bound(node, "exclusiveMinimum")
    hi = _bound(node, "maximum"), _bound(node, "exclusiveMaximum")
    for strict, others in ((lo[1], hi), (hi[1], lo)):
        if strict is None or not float(strict).is_integer():
            continue
        if any(other is not None and abs(other - strict) <= 1 for other in others):
            return True
    return False


def _bound(node: dict, key: str) -> int | float | None:
    value = node.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _format_unenforced_by_xgrammar(node: dict) -> bool:
    """A string format the last check holds outputs to (jsonschema's format checker) that xgrammar compiles as any
    string. Formats the checker does not know (int64, password) bind nothing, and apply to strings only."""
    fmt, types = node.get("format"), node.get("type")
    if not isinstance(fmt, str) or fmt in XGRAMMAR_FORMATS or fmt not in _CHECKED_FORMATS:
        return False
    return types is None or types == "string" or (isinstance(types, list) and "string" in types)


def _regex_elements(pattern: str):
    """Each element of a regex in order, as (index, text, outside a character class): an escape is one element
    (``\\d``), every other character one; a "]" right after a class's "[" is a literal of the class."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            yield i, pattern[i : i + 2], not in_class
            i += 2
            continue
        yield i, c, not in_class
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "]":
                yield i + 1, "]", False
                i += 1
        i += 1


def _backreference(text: str) -> bool:
    return len(text) == 2 and text[0] == "\\" and text[1] in "123456789k"


def _opens_lookaround(pattern: str, i: int) -> bool:
    return pattern[i : i + 2] == "(?" and (
        pattern[i + 2 : i + 3] in ("=", "!") or pattern[i + 2 : i + 4] in ("<=", "<!")
    )


def beyond_regular(pattern: str) -> bool:
    """Does the regex use lookaround or backreferences? xgrammar's regex conversion drops them (a pattern
    ``^(?=.*\\d)[a-z0-9]{4}$`` let "abcd" through); a regular automaton cannot enforce them at all."""
    return any(
        outside and (_backreference(text) or _opens_lookaround(pattern, i))
        for i, text, outside in _regex_elements(pattern)
    )


def without_lookaround(pattern: str) -> str | None:
    """The pattern with its lookaround groups taken out (``^(?!aws:)[a-z]+$`` -> ``^[a-z]+$``): a lookaround only
    narrows what matches, so the result matches a superset, the closest regular pattern. None if the pattern has
    backreferences (no such superset is simple) or cannot be read."""
    out: list[str] = []
    skip_to = -1  # inside a lookaround group being dropped, up to this index
    depth = 0
    for i, text, outside in _regex_elements(pattern):
        if skip_to < 0 and outside and _backreference(text):
            return None
        if skip_to >= 0:  # inside a dropped group: find its closing parenthesis
            if outside and text == "(":
                depth += 1
            elif outside and text == ")":
                depth -= 1
                if depth == 0:
                    skip_to = -1
            continue
        if outside and _opens_lookaround(pattern, i):
            skip_to, depth = i, 1
            continue
        out.append(text)
    return None if skip_to >= 0 else "".join(out)
