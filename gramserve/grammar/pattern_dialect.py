"""JSON Schema `pattern`s read one way by the backends, the last check and the client's validator.

Patterns are ECMA-262 regexes, and clients validate them with Python's `re` (jsonschema); llguidance reads them with
Rust's regex syntax, xgrammar with its own, the last check with the `regex` module. Where those differ, a grammar
wrote strings the check then refused (or passed strings jsonschema refuses): `[[:alpha:]]+` is a POSIX class to
Rust and `regex`, a class of `[:alph` and a `]` to ECMA-262 and `re`; `[a&&b]` is an intersection to Rust; xgrammar
reads `\\Z` as the letter Z. `for_backends` rewrites a pattern so every engine reads what `re` reads:

- an unescaped `[` inside a class (a nested class or a POSIX class to Rust and `regex`) is escaped;
- `&&` and `~~` inside a class (Rust's intersection and symmetric difference) are escaped;
- `\\A` becomes `^`, `\\Z` and `\\z` become `$` (anchors to `re`, as schema authors mean them: AWS's CloudFormation
  schemas write `\\A...\\Z`);
- an optional group `(...)?` becomes `(...){0,1}`, the same to every engine: xgrammar 0.2.9 made each part of an
  optional group optional on its own when one part repeats (`^a(bc+)?Z$` let "acZ" through, `^a(b\\d+)?Z$`
  "a1Z"), and reads `{0,1}` right.

`problem` names what cannot be rewritten so: `\\p` or `\\P` without braces (a class to Rust and `regex`, the letter
p to ECMA-262, an error to `re`).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from gramserve.grammar.schema_audit import schema_nodes

ANCHORS = {"A": "^", "Z": "$", "z": "$"}
CLASS_SET_OPERATORS = ("&&", "~~")


@functools.lru_cache(maxsize=4096)
def for_backends(pattern: str) -> str:
    """The pattern as Rust's regex, xgrammar and the `regex` module read it the way Python's `re` does."""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            escaped = pattern[i + 1]
            out.append(ANCHORS[escaped] if escaped in ANCHORS and not in_class else pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            elif c == "[":
                c = "\\["
            elif pattern.startswith(CLASS_SET_OPERATORS, i):
                out.append(f"\\{c}\\{c}")
                i += 2
                continue
            out.append(c)
            i += 1
            continue
        if c == ")" and pattern.startswith("?", i + 1):
            out.append("){0,1}")
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[":
            in_class = True
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a leading ] is a member of the class
                out.append("\\]")
                i += 1
    return "".join(out)


def problem(pattern: str) -> str | None:
    """What in the pattern the engines cannot be made to read alike, or None."""
    i, n = 0, len(pattern)
    while i < n - 1:
        if pattern[i] == "\\":
            if pattern[i + 1] in "pP" and (i + 2 >= n or pattern[i + 2] != "{"):
                return f"\\{pattern[i + 1]} without braces (write \\{pattern[i + 1]}{{L}})"
            i += 2
            continue
        i += 1
    return None


def dialect_patterns(schema: Any) -> Any:
    """`schema` with every `pattern` and `patternProperties` name through `for_backends` (the same object if none
    changes)."""
    if not isinstance(schema, dict) or not any(_rewritten(node) for node, _ in schema_nodes(schema)):
        return schema
    out = copy.deepcopy(schema)
    for node, _ in schema_nodes(out):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = for_backends(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {for_backends(k): v for k, v in node["patternProperties"].items()}
    return out


def node_patterns(node: dict) -> list[str]:
    """A schema node's regexes: its `pattern` and its `patternProperties` names."""
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    return patterns


def _rewritten(node: dict) -> bool:
    return any(for_backends(p) != p for p in node_patterns(node))
