"""Which arrays of a JSON schema's outputs must hold unique items, as the loop guard can tell them apart in the text:
the values of members with certain names, and the output itself.

No grammar backend enforces ``uniqueItems``: it is served relaxed and the last check catches copies. The loop guard
(``json_shape.py``) keeps items from ending as copies of earlier ones, in the arrays named here. A name counts if,
anywhere in the schema, a property of that name is an array marked ``uniqueItems`` (through local ``$ref`` and
``anyOf`` / ``oneOf`` / ``allOf`` too): the guard only narrows masks, so an array of the same name elsewhere that
allows copies just gets none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

_MAX_DEPTH = 16  # $ref hops followed from one property


@dataclass(frozen=True)
class UniqueArrays:
    keys: frozenset[str] = frozenset()  # member names whose value is a unique array
    root: bool = False  # the output itself is a unique array


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
                if '"' not in name and "\\" not in name and _marks_unique(schema, sub):
                    keys.add(name)
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return UniqueArrays(frozenset(keys), _marks_unique(schema, schema))


def _marks_unique(root: dict, node, depth: int = 0) -> bool:
    if not isinstance(node, dict) or depth > _MAX_DEPTH:
        return False
    if node.get("uniqueItems") is True:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/") and _marks_unique(root, _resolve(root, ref), depth + 1):
        return True
    return any(
        _marks_unique(root, member, depth + 1)
        for key in ("anyOf", "oneOf", "allOf")
        if isinstance(node.get(key), list)
        for member in node[key]
    )


def _resolve(root: dict, ref: str):
    """A local JSON pointer (``#/definitions/Tag``); None where it leads nowhere."""
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
