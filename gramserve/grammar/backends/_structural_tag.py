"""Structural tags (xgrammar's JSON format): normalization, and translation to llguidance Lark.

The spec is ``{"type": "structural_tag", "format": FORMAT}`` (the legacy
``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`` is
converted to a ``triggered_tags`` format). :func:`to_lark` supports the format types const_string,
json_schema (style "json"), any_text, regex, grammar (GBNF/EBNF or Lark), sequence, or, tag (string
or token begin/end, end may be a list), triggered_tags, tags_with_separator, optional, plus, star,
repeat. Others (token-level formats, dispatch, XML styles) raise GrammarCompileError.

Free text of ``triggered_tags`` may not contain a trigger (as in xgrammar): a trigger always opens
a tag.
"""

from __future__ import annotations

import json

from .base import GrammarCompileError


def normalize(text: str) -> dict:
    """Parse a structural tag spec; returns the ``{"type": "structural_tag", "format": ...}`` form."""
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise GrammarCompileError(f"structural_tag: not valid JSON ({e})") from None
    if not isinstance(tag, dict):
        raise GrammarCompileError("structural_tag: expected a JSON object")
    if "format" not in tag and "structures" in tag:
        structures = tag["structures"]
        triggers = tag.get("triggers", [])
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise GrammarCompileError("structural_tag: 'structures' and 'triggers' must be lists")
        tags = []
        for s in structures:
            if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
                raise GrammarCompileError("structural_tag: each structure needs string 'begin' and 'end'")
            schema = s.get("schema", {})
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise GrammarCompileError(f"structural_tag: invalid schema JSON ({e})") from None
            tags.append(
                {
                    "type": "tag",
                    "begin": s["begin"],
                    "content": {"type": "json_schema", "json_schema": schema},
                    "end": s["end"],
                }
            )
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    if tag.get("type", "structural_tag") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise GrammarCompileError('structural_tag: expected {"type": "structural_tag", "format": {...}}')
    _declare_required_in(tag["format"])
    return tag


def _declare_required_in(fmt) -> None:
    """Apply schema_normalize.declare_required to every json_schema content (in place)."""
    from gramserve.grammar.schema_normalize import declare_required

    map_json_schemas(fmt, declare_required)


def map_json_schemas(fmt, fn) -> None:
    """Replace every json_schema content of a structural tag format by fn(schema) (in place)."""
    stack = [fmt]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
                node["json_schema"] = fn(node["json_schema"])
                continue
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def tag_schemas(text: str) -> list[dict]:
    """The JSON schemas (object form) inside a structural tag spec, in no particular order."""
    found: list[dict] = []

    def collect(schema: dict) -> dict:
        found.append(schema)
        return schema

    map_json_schemas(normalize(text)["format"], collect)
    return found


class _LarkBuilder:
    """Builds one Lark grammar (plus side grammars for nested EBNF) from a structural tag format."""

    def __init__(self, json_options: dict | None, gbnf_to_lark, regex_to_lark):
        self.rules: list[str] = []
        self.side_grammars: list[dict] = []
        self.n = 0
        self.json_options = json_options or {}
        self.gbnf_to_lark = gbnf_to_lark
        self.regex_to_lark = regex_to_lark

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.n}"

    # Each method returns a Lark expression usable inside a rule body.
    def expr(self, f) -> str:
        if not isinstance(f, dict) or not isinstance(f.get("type"), str):
            raise GrammarCompileError("structural_tag: each format must be an object with a 'type'")
        t = f["type"]
        handler = getattr(self, "_f_" + t, None)
        if handler is None:
            raise GrammarCompileError(f"structural_tag: format type {t!r} is not supported by the llguidance backend")
        return handler(f)

    @staticmethod
    def lit(s: str) -> str:
        if not isinstance(s, str):
            raise GrammarCompileError("structural_tag: expected a string")
        return json.dumps(s) if s else ""

    def _special(self, tok) -> str:
        if isinstance(tok, dict) and tok.get("type") == "token":
            tok = tok.get("token")
        if isinstance(tok, int):
            return f"<[{tok}]>"
        if isinstance(tok, str) and tok.startswith("<") and tok.endswith(">"):
            return tok
        raise GrammarCompileError(f"structural_tag: unsupported token reference {tok!r}")

    def _begin_end(self, x) -> str:
        if isinstance(x, str):
            return self.lit(x)
        if isinstance(x, list):
            alts = [self.lit(s) for s in x]
            if any(a == "" for a in alts):
                return "(" + " | ".join(a for a in alts if a) + ")?"
            return "(" + " | ".join(alts) + ")"
        return self._special(x)

    def _f_const_string(self, f) -> str:
        return self.lit(f.get("value", ""))

    def _f_json_schema(self, f) -> str:
        if f.get("style", "json") != "json":
            raise GrammarCompileError(
                f"structural_tag: json_schema style {f.get('style')!r} is not supported by the llguidance backend"
            )
        if f.get("any_order") or f.get("excludes"):
            raise GrammarCompileError(
                "structural_tag: json_schema any_order/excludes are not supported by the llguidance backend"
            )
        schema = f.get("json_schema", {})
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarCompileError("structural_tag: json_schema must be an object or true")
        opts = dict(self.json_options)
        ws = f.get("max_whitespace_cnt")
        if isinstance(ws, int) and ws > 0:
            opts["whitespace_flexible"] = True
            opts["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{ws}}}"
        if opts:
            schema = dict(schema)
            schema["x-guidance"] = {**opts, **(schema.get("x-guidance") or {})}
        name = self.fresh("json")
        self.rules.append(f"{name}: %json {json.dumps(schema)}")
        return name

    def _text_terminal(self, excludes: list[str], max_chars=None) -> str:
        name = self.fresh("TEXT").upper()
        body = "/(?s:.)*/" if max_chars is None else f"/(?s:.){{0,{int(max_chars)}}}/"
        if excludes:
            alts = "|".join(self.regex_to_lark(_re_escape(e)) for e in excludes if e)
            body = f"{body} & ~/(?s:.*)({alts})(?s:.*)/"
        self.rules.append(f"{name}: {body}")
        return name

    def _f_any_text(self, f) -> str:
        if f.get("max_tokens") is not None:
            raise GrammarCompileError("structural_tag: any_text max_tokens is not supported by the llguidance backend")
        return self._text_terminal(list(f.get("excludes") or []), f.get("max_chars"))

    def _f_regex(self, f) -> str:
        name = self.fresh("RX").upper()
        self.rules.append(f"{name}: /{self.regex_to_lark(f.get('pattern', ''))}/")
        return name

    def _f_grammar(self, f) -> str:
        text = f.get("grammar", "")
        from .base import looks_like_gbnf

        lark = self.gbnf_to_lark(text) if looks_like_gbnf(text) else text
        name = self.fresh("sub")
        self.side_grammars.append({"name": name, "lark_grammar": lark})
        return "@" + name

    def _f_sequence(self, f) -> str:
        parts = [self.expr(e) for e in f.get("elements", [])]
        parts = [p for p in parts if p]
        return "(" + " ".join(parts) + ")" if parts else ""

    def _f_or(self, f) -> str:
        parts = [self.expr(e) for e in f.get("elements", [])]
        if not parts:
            raise GrammarCompileError("structural_tag: 'or' needs elements")
        if any(p == "" for p in parts):
            return "(" + " | ".join(p for p in parts if p) + ")?"
        return "(" + " | ".join(parts) + ")"

    def _wrap(self, f, op: str) -> str:
        inner = self.expr(f.get("content"))
        return f"({inner}){op}" if inner else ""

    def _f_optional(self, f) -> str:
        return self._wrap(f, "?")

    def _f_plus(self, f) -> str:
        return self._wrap(f, "+")

    def _f_star(self, f) -> str:
        return self._wrap(f, "*")

    def _f_repeat(self, f) -> str:
        lo, hi = int(f.get("min", 0)), int(f.get("max", -1))
        return self._wrap(f, f"{{{lo},}}" if hi < 0 else f"{{{lo},{hi}}}")

    def _tag(self, f, skip_begin: str = "") -> str:
        if not isinstance(f, dict) or f.get("type", "tag") != "tag":
            raise GrammarCompileError("structural_tag: expected a tag")
        begin = f.get("begin", "")
        if skip_begin:
            begin = begin[len(skip_begin) :]
        content = f.get("content", {"type": "const_string", "value": ""})
        end = f.get("end", "")
        # any_text content stops at the first end string (like xgrammar), so make it lazy.
        if isinstance(content, dict) and content.get("type") == "any_text" and isinstance(end, (str, list)) and end:
            ends = [end] if isinstance(end, str) else end
            if all(isinstance(e, str) and e for e in ends):
                body = self._f_any_text(content)
                lazy = self.fresh("lazy")
                end_alt = " | ".join(self.lit(e) for e in ends)
                self.rules.append(f"{lazy}[lazy]: {body} ({end_alt})")
                return " ".join(p for p in (self._begin_end(begin), lazy) if p)
        parts = [p for p in (self._begin_end(begin), self.expr(content), self._begin_end(end)) if p]
        return "(" + " ".join(parts) + ")" if parts else ""

    def _f_tag(self, f) -> str:
        return self._tag(f)

    def _f_tags_with_separator(self, f) -> str:
        tags = [self._tag(t) for t in f.get("tags", [])]
        if not tags:
            raise GrammarCompileError("structural_tag: tags_with_separator needs tags")
        one = "(" + " | ".join(tags) + ")"
        if f.get("stop_after_first"):
            return one if f.get("at_least_one") else f"{one}?"
        sep = self.lit(f.get("separator", ""))
        many = f"{one} ({sep} {one})*"
        return f"({many})" if f.get("at_least_one") else f"({many})?"

    def _f_triggered_tags(self, f) -> str:
        triggers = f.get("triggers", [])
        tags = f.get("tags", [])
        if not triggers or not tags or not all(isinstance(t, str) and t for t in triggers):
            raise GrammarCompileError("structural_tag: triggered_tags needs non-empty triggers and tags")
        excludes = list(f.get("excludes") or [])
        # Free text may contain neither a trigger nor an excluded string.
        text = self._text_terminal(excludes + triggers)
        alternatives = []
        for trig in triggers:
            mine = [
                t
                for t in tags
                if isinstance(t, dict) and isinstance(t.get("begin"), str) and t["begin"].startswith(trig)
            ]
            if not mine:
                continue
            head = self.fresh("trig")
            self.rules.append(f"{head}[lazy]: {text} {self.lit(trig)}")
            bodies = " | ".join(self._tag(t, skip_begin=trig) for t in mine)
            alternatives.append(f"{head} ({bodies})")
        for t in tags:
            if not any(isinstance(t.get("begin"), str) and t["begin"].startswith(trig) for trig in triggers):
                raise GrammarCompileError(f"structural_tag: tag begin {t.get('begin')!r} matches no trigger")
        one = "(" + " | ".join(alternatives) + ")"
        # As in xgrammar, at_least_one means the output starts with a tag (no text before it).
        first = "(" + " | ".join(self._tag(t) for t in tags) + ")"
        if f.get("stop_after_first"):
            return first if f.get("at_least_one") else f"({one} | {text})"
        return f"({first} {one}* {text})" if f.get("at_least_one") else f"({one}* {text})"


def _re_escape(s: str) -> str:
    from .base import regex_escape

    return regex_escape(s)


def to_llguidance(tag: dict, json_options: dict | None = None) -> str:
    """An llguidance grammar (Lark text, or the JSON grammar list when side grammars are needed)."""
    from llguidance import regex_to_lark
    from llguidance.gbnf_to_lark import gbnf_to_lark

    b = _LarkBuilder(json_options, gbnf_to_lark, regex_to_lark)
    top = b.expr(tag["format"])
    lark = "%llguidance {}\nstart: " + (top if top else '""') + "\n" + "\n".join(b.rules) + "\n"
    if not b.side_grammars:
        return lark
    return json.dumps({"grammars": [{"name": "struct_tag", "lark_grammar": lark}, *b.side_grammars]})
