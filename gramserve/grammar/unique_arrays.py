"""Which arrays of a JSON schema's outputs must hold unique items, as the loop guard can tell them apart in the text:
the values of members with certain names, and the output itself; and, where an array's items come from a small
closed set (an ``enum``, ``const``, booleans, a narrow integer range), that set as JSON texts.

No grammar backend enforces ``uniqueItems``: it is served relaxed and the last check catches copies. The loop guard
(``json_shape.py``) keeps items from ending as copies of earlier ones, in the arrays named here. A name counts if,
anywhere in the schema, a property of that name is an array marked ``uniqueItems`` (through local ``$ref`` and
``anyOf`` / ``oneOf`` / ``allOf`` too): the guard only narrows masks, so an array of the same name elsewhere that
allows copies just gets none. An item of a closed set cannot be altered into another value once it copies an earlier
one (``["read", "read"]``: after ``"rea`` only ``d"`` is left), so for those arrays the guard keeps each item to the
values not used yet (``unique_choices.py``), and the array to its end once none is left.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from gramserve.grammar.schema_normalize import resolve_ref

_MAX_DEPTH = 16  # $ref hops followed from one property
_MAX_NODES = 2000  # schemas one walk looks at
MAX_DOMAIN = 256  # a closed set of item values larger than this is treated as open
_MAX_INT_RANGE = 64  # an integer range of more values than this is open


@dataclass(frozen=True)
class UniqueArrays:
    keys: frozenset[str] = frozenset()  # member names whose value is a unique array
    root: bool = False  # the output itself is a unique array
    # member name -> the JSON texts its unique array's items are drawn from (closed sets only)
    domains: tuple[tuple[str, frozenset[str]], ...] = ()
    root_domain: frozenset[str] | None = None


@lru_cache(maxsize=256)
def unique_arrays(schema_text: str) -> UniqueArrays:
    """The unique arrays of a JSON schema (its text, as compiled); none if it does not parse."""
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError):
        return UniqueArrays()
    if not isinstance(schema, dict):
        return UniqueArrays()
    keys: set[str] = set()
    domains: dict[str, frozenset[str] | None] = {}  # None: some array of that name is open
    plain: set[str] = set()  # names that some property without uniqueItems has
    stack: list = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                if '"' in name or "\\" in name:
                    continue
                if _marks_unique(schema, sub):
                    keys.add(name)
                    found = _closed_items(schema, sub)
                    domains[name] = found if domains.get(name, found) == found else None
                else:
                    plain.add(name)  # an array of that name may allow copies: its items may repeat
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    closed = tuple(sorted((k, d) for k, d in domains.items() if d is not None and k not in plain))
    root = _marks_unique(schema, schema)
    return UniqueArrays(frozenset(keys), root, closed, _closed_items(schema, schema) if root else None)


def _marks_unique(root: dict, node) -> bool:
    return bool(_unique_nodes(root, node))


def _unique_nodes(root: dict, node, depth: int = 0, budget: list[int] | None = None) -> list[dict]:
    """The array schemas marked uniqueItems that `node` is, or holds through $ref and anyOf / oneOf / allOf (at most
    _MAX_NODES schemas looked at: references that branch back into themselves grow exponentially)."""
    budget = [_MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if not isinstance(node, dict) or depth > _MAX_DEPTH or budget[0] < 0:
        return []
    out = [node] if node.get("uniqueItems") is True else []
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        out += _unique_nodes(root, resolve_ref(root, ref), depth + 1, budget)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            for member in node[key]:
                out += _unique_nodes(root, member, depth + 1, budget)
    return out


def _closed_items(root: dict, node) -> frozenset[str] | None:
    """The JSON texts (compact) of the values a unique array's items are drawn from, if `node` holds exactly one
    unique array and its items form a small closed set of scalars; None otherwise."""
    arrays = _unique_nodes(root, node)
    if len(arrays) != 1 or "prefixItems" in arrays[0] or isinstance(arrays[0].get("items"), list):
        return None
    return closed_set(root, arrays[0].get("items"))


def closed_set(root: dict, schema, depth: int = 0, budget: list[int] | None = None) -> frozenset[str] | None:
    """The values a schema allows, as compact JSON texts, if they are few scalars (strings in ASCII); None if open
    (or past _MAX_NODES schemas looked at).

    It may be narrower than the schema (a sibling of ``$ref`` in a draft that ignores it): the guard only narrows
    masks, so a value left out is one the output does not pick, never an invalid one."""
    budget = [_MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if not isinstance(schema, dict) or depth > _MAX_DEPTH or budget[0] < 0:
        return None
    found: frozenset[str] | None = None

    def narrow(values: frozenset[str] | None) -> None:
        nonlocal found
        if values is not None:
            found = values if found is None else found & values

    if "const" in schema:
        narrow(_texts([schema["const"]]))
        if found is None:
            return None  # a const that is not a plain scalar
    if isinstance(schema.get("enum"), list):
        values = _texts(schema["enum"])
        if values is None:
            return None
        narrow(values)
    narrow(_typed(schema))
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        narrow(closed_set(root, resolve_ref(root, ref), depth + 1, budget))
    for member in schema.get("allOf") or []:
        narrow(closed_set(root, member, depth + 1, budget))
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            sets = [closed_set(root, m, depth + 1, budget) for m in members]
            if all(s is not None for s in sets):
                narrow(frozenset().union(*sets))
    if found is not None and isinstance(schema.get("type"), (str, list)):
        types = _types(schema["type"])
        if "number" in types:
            types.add("integer")
        found = frozenset(t for t in found if _type_of(t) in types)
    return found if found is not None and len(found) <= MAX_DOMAIN else None


def _texts(values: list) -> frozenset[str] | None:
    out = set()
    for v in values:
        if isinstance(v, (dict, list)) or (isinstance(v, float) and v != v):
            return None
        text = json.dumps(v, separators=(",", ":"))
        if not text.isascii() or "\\" in text:
            return None  # backends may write it another way
        out.add(text)
    return frozenset(out)


def _typed(schema: dict) -> frozenset[str] | None:
    """The closed set a `type` alone makes (booleans, null, a narrow integer range); None if open."""
    types = _types(schema.get("type"))
    if not types:
        return None
    out: set[str] = set()
    for t in types:
        if t == "boolean":
            out |= {"true", "false"}
        elif t == "null":
            out.add("null")
        elif t == "integer" and (span := _int_range(schema)) is not None:
            out |= {str(i) for i in span}
        else:
            return None
    return frozenset(out)


def _int_range(schema: dict) -> range | None:
    """The integers `minimum` / `maximum` (or their exclusive forms, and `multipleOf`) allow, if few; else None."""
    lows, highs = [], []
    for key, to, bound in (
        ("minimum", lows, math.ceil),
        ("maximum", highs, math.floor),
        ("exclusiveMinimum", lows, lambda x: math.floor(x) + 1),
        ("exclusiveMaximum", highs, lambda x: math.ceil(x) - 1),
    ):
        b = schema.get(key)
        if b is None:
            continue
        if isinstance(b, bool) or not isinstance(b, (int, float)) or (isinstance(b, float) and not math.isfinite(b)):
            return None  # draft 4's boolean exclusive bounds, or no bound at all
        to.append(bound(b))
    if not lows or not highs or not 0 <= min(highs) - max(lows) < _MAX_INT_RANGE:
        return None  # open, too wide, or empty
    step = schema.get("multipleOf")
    values = range(max(lows), min(highs) + 1)
    if step is None:
        return values
    if isinstance(step, int) and not isinstance(step, bool) and step > 0:
        return range(next((v for v in values if v % step == 0), values.stop), values.stop, step)
    return None


def _types(value) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {t for t in value if isinstance(t, str)}
    return set()


def _type_of(text: str) -> str:
    if text.startswith('"'):
        return "string"
    if text in ("true", "false"):
        return "boolean"
    if text == "null":
        return "null"
    return "integer" if text.lstrip("-").isdigit() else "number"
