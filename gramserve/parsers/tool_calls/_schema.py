"""Parameter schemas prepared for grammars: local ``$ref``s inlined.

xgrammar (0.2.8) does not resolve ``#/$defs/...`` references inside a structural tag's json_schema
(it rejects valid instances), and pydantic-made tool schemas (``openai.pydantic_function_tool``)
use them for nested models. Recursive references are left as they are, with the definitions, and so is every
reference when inlining would grow the schema past INLINE_BUDGET nodes (definitions that each use the next twice
double at every level: 21 levels of a 2 KB schema would inline into millions of nodes).
"""

from __future__ import annotations

_PREFIXES = ("#/$defs/", "#/definitions/")
INLINE_BUDGET = 10_000  # dict / list nodes the inlined schema may hold (a few ms to build)


class _OverBudget(Exception):
    pass


def inline_refs(schema: dict) -> dict:
    defs: dict = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            defs.update({f"#/{key}/{name}": s for name, s in schema[key].items()})
    if not defs:
        return schema
    recursive = False
    nodes = 0

    def walk(node, active: tuple[str, ...]):
        nonlocal recursive, nodes
        if isinstance(node, (list, dict)):
            nodes += 1
            if nodes > INLINE_BUDGET:
                raise _OverBudget
        if isinstance(node, list):
            return [walk(v, active) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_PREFIXES) and ref in defs:
            if ref in active:
                recursive = True
                return node
            target = walk(defs[ref], (*active, ref))
            siblings = {k: walk(v, active) for k, v in node.items() if k != "$ref"}
            return {**target, **siblings} if isinstance(target, dict) else target
        return {k: walk(v, active) for k, v in node.items() if k not in ("$defs", "definitions")}

    try:
        out = walk(schema, ())
    except _OverBudget:
        return schema
    if recursive:
        out.update({k: schema[k] for k in ("$defs", "definitions") if k in schema})
    return out
