"""EBNF (GBNF style, ``root ::= ...``) for Python call arguments built from a JSON Schema.

Covered: string, integer, number, boolean, null, enum/const, type lists, anyOf/oneOf, arrays
(``items``), objects with ``properties`` (as dict literals, keys in schema order); anything else is
a generic Python literal. Keyword arguments and dict keys follow the schema's property order;
required ones must appear. String constraints (pattern, lengths) and numeric bounds are not
enforced by the grammar.
"""

from __future__ import annotations

import json

_BASE = r"""
ws ::= [ ]?
pystr ::= "'" ([^'\\\n\r] | "\\" [^\n\r])* "'" | "\"" ([^"\\\n\r] | "\\" [^\n\r])* "\""
pyint ::= "-"? ([0-9] | [1-9] [0-9]+)
pynum ::= pyint ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
pybool ::= "True" | "False"
pynone ::= "None"
pyval ::= pystr | pynum | pybool | pynone | pylist | pydict
pylist ::= "[" ws (pyval (ws "," ws pyval)*)? ws "]"
pydict ::= "{" ws (pystr ws ":" ws pyval (ws "," ws pystr ws ":" ws pyval)*)? ws "}"
"""

_SIMPLE = {"string": "pystr", "integer": "pyint", "number": "pynum", "boolean": "pybool", "null": "pynone"}


def lit(s: str) -> str:
    """An EBNF string literal matching s exactly."""
    return json.dumps(s, ensure_ascii=False)


def py_literal_alternatives(value) -> list[str]:
    """Python source forms of a JSON value (strings in both quote styles)."""
    if isinstance(value, str):
        return list(dict.fromkeys([repr(value), json.dumps(value, ensure_ascii=False)]))
    if value is None or isinstance(value, (bool, int, float)):
        return [repr(value)]
    return [repr(value)]


class PyGrammar:
    def __init__(self) -> None:
        self.rules: list[str] = []
        self.n = 0

    def rule(self, body: str) -> str:
        self.n += 1
        name = f"r{self.n}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def value(self, schema, depth: int = 0) -> str:
        if not isinstance(schema, dict) or depth > 8:
            return "pyval"
        for key in ("enum", "const"):
            if key in schema:
                values = schema[key] if key == "enum" else [schema[key]]
                if not isinstance(values, list) or not values:
                    return "pyval"
                alts = [lit(a) for v in values for a in py_literal_alternatives(v)]
                return self.rule(" | ".join(dict.fromkeys(alts)))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.rule(" | ".join(self.value(s, depth + 1) for s in schema[key]))
        t = schema.get("type")
        if isinstance(t, list):
            if not t:
                return "pyval"
            return self.rule(" | ".join(self.value({**schema, "type": x}, depth + 1) for x in t))
        if t in _SIMPLE:
            return _SIMPLE[t]
        if t == "array":
            items = schema.get("items")
            v = self.value(items, depth + 1) if isinstance(items, dict) else "pyval"
            return self.rule(f'"[" ws ({v} (ws "," ws {v})*)? ws "]"')
        if t == "object" or (t is None and isinstance(schema.get("properties"), dict)):
            props = schema.get("properties")
            if not isinstance(props, dict) or not props:
                return "pydict"
            required = set(schema.get("required") or [])
            items = []
            for k, s in props.items():
                key = " | ".join(lit(a) for a in py_literal_alternatives(k))
                items.append((f'({key}) ws ":" ws {self.value(s, depth + 1)}', k in required))
            body = self.ordered(items, 'ws "," ws')
            return self.rule(f'"{{" ws {body} ws "}}"')
        return "pyval"

    def ordered(self, items: list[tuple[str, bool]], sep: str) -> str:
        """Items in order, the optional ones optional, separated by sep; returns a rule name."""
        n = len(items)
        after = [""] * (n + 1)  # after[k]: items k.. when something came before
        first = [""] * (n + 1)  # first[k]: items k.. when nothing came before
        after[n] = first[n] = self.rule('""')
        for k in range(n - 1, -1, -1):
            expr, required = items[k]
            a_req = f"{sep} {expr} {after[k + 1]}"
            after[k] = self.rule(a_req if required else f"({a_req}) | {after[k + 1]}")
            f_req = f"{expr} {after[k + 1]}"
            first[k] = self.rule(f_req if required else f"({f_req}) | {first[k + 1]}")
        return first[0]

    def kwargs(self, parameters: dict) -> str:
        """The keyword arguments of a call: ``a=1, b='x'``; returns a rule name."""
        props = parameters.get("properties") if isinstance(parameters, dict) else None
        if not isinstance(props, dict):
            props = {}
        required = set(parameters.get("required") or []) if isinstance(parameters, dict) else set()
        items = [(f"{lit(k + '=')} ws {self.value(s)}", k in required) for k, s in props.items() if k.isidentifier()]
        return self.ordered(items, '"," ws')

    def text(self, root_body: str) -> str:
        return f"root ::= {root_body}\n" + "\n".join(self.rules) + _BASE
