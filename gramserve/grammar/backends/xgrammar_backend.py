"""XGrammar backend: json_schema, json_object, regex, ebnf, structural_tag, choice.

* The TokenizerInfo is built from our own byte table (``_vocab``) rather than
  ``TokenizerInfo.from_huggingface``: the latter treats special tokens such as ``<|im_start|>`` as
  literal text, so a free-text grammar would allow them. Special tokens get an empty string, which
  xgrammar never allows; ``vocab_size`` is the logits width (columns past the tokenizer are masked).
* One ``GrammarCompiler`` (with its cache) per backend.
* ebnf: GBNF / xgrammar EBNF (``root ::= ...``); text without ``::=`` rules is compiled as Lark
  (``start: ...``) with ``compile_lark``.
* structural_tag: xgrammar's format (``{"type": "structural_tag", "format": {...}}``) and the legacy
  one (``{"type": "structural_tag", "structures": [...], "triggers": [...]}``).
* Whitespace (GrammarOptions.max_whitespace): 0 -> compact JSON (separators "," ":"; xgrammar 0.2.8
  still writes ", " in its built-in rules for untyped arrays/objects, so we patch those two rules
  in the generated EBNF); n -> at most n
  consecutive whitespace characters between JSON tokens (``max_whitespace_cnt``, also injected
  into json_schema contents of structural tags), compiled with xgrammar's bounded repetitions written
  out inline (``inline_bounded_whitespace``: same language, much faster fills); None -> any whitespace.
* JSON Schema keywords (xgrammar 0.2.8, probed): enforced: type (also lists), properties, required,
  additionalProperties (false or a schema), items, prefixItems, min/maxItems, enum, const (object
  and array consts only in their compact serialization), anyOf, oneOf (as anyOf), $ref/$defs
  (recursive too), pattern, min/maxLength, format (date-time, email, uri, uuid, ipv4, ...),
  minimum/maximum/exclusive* (integers and numbers), multipleOf, min/maxProperties, propertyNames.
  Ignored (invalid instances accepted): allOf, not, if/then/else, uniqueItems, contains,
  dependentRequired. Valid instances rejected: properties out of the declared order,
  patternProperties (or an internal compile error), unanchored ``pattern`` (matched as a whole
  string). With ``strict_json`` undeclared properties/items are forbidden.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from gramserve.sampling.bitmask import check_bitmask, check_bitmask_row, clear_columns_from, set_only_tokens

from ._structural_tag import normalize as normalize_structural_tag
from .base import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarCompileError,
    GrammarOptions,
    GrammarSpec,
    Matcher,
    looks_like_gbnf,
    parse_choices,
    parse_json_schema,
)

if TYPE_CHECKING:
    from gramserve.grammar.fill import FillPool

logger = logging.getLogger(__name__)


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: xgr.CompiledGrammar, eos: list[int], text_vocab: int, vocab_size: int):
        self._m = xgr.GrammarMatcher(compiled)
        self._eos = eos
        self._text_vocab = text_vocab
        self._vocab_size = vocab_size

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._m.is_terminated():
            return token_id in self._eos
        if not 0 <= token_id < self._vocab_size:
            return False
        if token_id >= self._text_vocab and token_id not in self._eos:
            return False
        try:
            return self._m.accept_token(token_id)
        except Exception as e:  # noqa: BLE001 - never crash the scheduler on a bad token
            logger.warning("xgrammar accept_token(%d) failed: %s", token_id, e)
            return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask_row(bitmask, row, self._vocab_size)
        if self._m.is_terminated():
            set_only_tokens(bitmask, row, self._eos)
            return
        self._m.fill_next_token_bitmask(bitmask, row)
        if bitmask.shape[1] * 32 > self._vocab_size:
            clear_columns_from(bitmask, row, self._vocab_size)

    @classmethod
    def fill_rows(cls, rows: Sequence[tuple[XGrammarMatcher, int]], bitmask: torch.Tensor, pool: FillPool) -> None:
        """One ``batch_fill_next_token_bitmask`` for the live matchers, then ``fill_bitmask``'s special
        cases: terminated matchers allow only EOS, columns past the vocabulary are cleared."""
        live: dict[int, tuple[list, list[int]]] = {}  # vocab size -> (xgrammar matchers, rows)
        for m, row in rows:
            if m._m.is_terminated():
                m.fill_bitmask(bitmask, row)
                continue
            matchers, live_rows = live.setdefault(m._vocab_size, ([], []))
            matchers.append(m._m)
            live_rows.append(row)
        threads = pool.threads_for(len(rows), cls.__name__)
        batch = pool.executor("xgrammar", threads, xgr.BatchGrammarMatcher)
        t0 = time.perf_counter()
        for vocab_size, (matchers, live_rows) in live.items():
            check_bitmask(bitmask, vocab_size)
            batch.batch_fill_next_token_bitmask(matchers, bitmask, live_rows)
            if bitmask.shape[1] * 32 > vocab_size:
                clear_columns_from(bitmask, live_rows, vocab_size)
        pool.record(cls.__name__, sum(len(r) for _, r in live.values()), time.perf_counter() - t0, threads)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def can_terminate(self) -> bool:
        return self._m.is_terminated() or self._m.is_completed()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: GrammarOptions | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids, options)
        encoded = [tok if tok is not None else b"" for tok in self.vocab.tokens[: self.vocab_size]]
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType.RAW,
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_token_ids,
            add_prefix_space=False,
        )
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=max(1, self.options.compile_threads),
            cache_enabled=True,
            cache_limit_bytes=self.options.cache_limit_bytes,
        )

    # -- compile -------------------------------------------------------------------------------

    def _json_kwargs(self) -> dict:
        ws = self.options.max_whitespace
        kw: dict = {"strict_mode": bool(self.options.strict_json)}
        if ws is None:
            kw["any_whitespace"] = True
        elif ws <= 0:
            kw["any_whitespace"] = False
            kw["separators"] = (",", ":")
        else:
            kw["any_whitespace"] = True
            kw["max_whitespace_cnt"] = int(ws)
        return kw

    def _compile(self, spec: GrammarSpec) -> object:
        try:
            return self._compile_kind(spec)
        except GrammarCompileError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own errors
            raise GrammarCompileError(f"xgrammar could not compile the {spec.kind} grammar: {_clean_error(e)}") from e

    def _compile_kind(self, spec: GrammarSpec) -> object:
        kind, text = spec.kind, spec.text
        if kind == "json_schema":
            schema = parse_json_schema(text)
            if isinstance(schema, bool):  # true: any JSON value; false: nothing
                if not schema:
                    raise GrammarCompileError("json_schema: the schema `false` accepts no value")
                schema = {}
            return self._compile_json(json.dumps(schema))
        if kind == "json_object":
            return self._compile_json(JSON_OBJECT_SCHEMA)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "ebnf":
            if looks_like_gbnf(text):
                return self.compiler.compile_grammar(text)
            try:
                return self.compiler.compile_lark(text)
            except Exception as e:  # noqa: BLE001
                raise GrammarCompileError(
                    f"xgrammar: the grammar is neither GBNF/EBNF (`root ::= ...`) nor valid Lark: {e}"
                ) from None
        if kind == "choice":
            choices = parse_choices(text)
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return self.compiler.compile_grammar(ebnf)
        if kind == "structural_tag":
            return self._compile_structural_tag(self._structural_tag_json(text))
        raise GrammarCompileError(f"xgrammar: unsupported grammar kind {kind!r}")

    def _compile_json(self, schema: str) -> xgr.CompiledGrammar:
        """xgrammar's grammar for the schema, patched where its printed form is wrong or slow (see the regexes
        below), then compiled."""
        kw = self._json_kwargs()
        grammar = xgr.Grammar.from_json_schema(schema, **kw)
        ebnf = str(grammar)
        fixed = _BOUNDED_STRING_CHARS.sub(_JSON_STRING_CHAR, ebnf)
        if kw.get("separators") == (",", ":"):
            fixed = _COMPACT_FIX.sub(r'\1"," basic_', fixed)
        if "max_whitespace_cnt" in kw:
            fixed = inline_bounded_whitespace(fixed)
        return self.compiler.compile_grammar(grammar if fixed == ebnf else fixed)

    def _compile_structural_tag(self, tag: str) -> xgr.CompiledGrammar:
        """The tag's grammar with bounded strings fixed (as in ``_compile_json``) and, with bounded whitespace, the
        whitespace repetitions of its JSON contents written out (tool-call arguments: 2 us a fill instead of 10-235
        us next to whitespace). xgrammar's own compile if its printed grammar does not parse back (it then reports
        its own error, if any)."""
        try:
            ebnf = str(xgr.Grammar.from_structural_tag(tag))
            fixed = _BOUNDED_STRING_CHARS.sub(_JSON_STRING_CHAR, ebnf)
            if self.options.max_whitespace is not None and self.options.max_whitespace > 0:
                fixed = inline_bounded_whitespace(fixed)
            if fixed != ebnf:
                return self.compiler.compile_grammar(fixed)
        except Exception as e:  # noqa: BLE001 - compile_structural_tag below gives the error or the grammar
            logger.debug("structural tag through EBNF failed (%s); compiling it as xgrammar does", e)
        return self.compiler.compile_structural_tag(tag)

    def _structural_tag_json(self, text: str) -> str:
        tag = normalize_structural_tag(text)
        ws = self.options.max_whitespace
        if ws is not None and ws > 0:
            _inject_whitespace(tag, int(ws))
        return json.dumps(tag)

    def matcher(self, compiled: object) -> Matcher:
        if not isinstance(compiled, xgr.CompiledGrammar):
            raise TypeError("not a grammar compiled by the xgrammar backend")
        return XGrammarMatcher(compiled, self.eos_token_ids, self.text_vocab_size, self.vocab_size)


_LOG_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+\.(?:cc|h|cpp):\d+:\s*", re.M)


def _clean_error(e: BaseException) -> str:
    """xgrammar's C++ errors start with a log prefix like "[03:52:41] /project/cpp/x.cc:3567: "."""
    msg = _LOG_PREFIX.sub("", str(e)).strip() or type(e).__name__
    if msg.startswith("Check failed"):
        msg = f"internal xgrammar error ({msg.rstrip(':')})"
    return msg if len(msg) <= 2000 else msg[:2000] + " ..."


# Strings with minLength/maxLength: xgrammar 0.2.8 writes their characters as `[^\"\\\r\n]`, which lets raw control
# characters (a tab, \x07) into the string: not JSON. The unbounded string rule excludes \0-\x1f as JSON requires.
_BOUNDED_STRING_CHARS = re.compile(r'(?m)^(\w+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$')
_JSON_STRING_CHAR = r'\1[^\\0-\\x1f\\"\\\\]\2'

# Built-in rules for untyped arrays/objects: `basic_array_items ::= ((", " basic_any))` etc.
_COMPACT_FIX = re.compile(r'^(basic_\w+ ::= \(\()", " basic_', re.M)

# max_whitespace_cnt=n: xgrammar writes each place where JSON allows whitespace as a bounded repetition of a rule
# of its own, `whitespace_7{0, n}` with `whitespace_7 ::= (([ \n\r\t]))`. Its matcher cannot use its precomputed
# token masks across such a repetition and checks most of the vocabulary at run time: a fill after `"year":` took
# 8.7 us a row against 0.7 us with the repetition written out inline as `("" | [ \n\r\t] | [ \n\r\t] [ \n\r\t])`,
# which is the same language (docs/benchmarks.md, "Bounded whitespace").
_WS_RULE = re.compile(r"^(whitespace(?:_\d+)?) ::= (.*)$", re.M)
# String literals and character classes are matched too, so that text inside them is left as it is.
_WS_REPEAT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\b(whitespace(?:_\d+)?)\{0, (\d+)\}')
_WS_CLASS = "(([ \\n\\r\\t]))"


def inline_bounded_whitespace(ebnf: str) -> str:
    """Write each `whitespace_k{0, n}` out as the alternatives of 0 to n whitespace characters. Unchanged unless every
    `whitespace*` rule is the single whitespace character class (the form xgrammar 0.2 generates)."""
    rules = dict(_WS_RULE.findall(ebnf))
    if not rules or any(body.strip() != _WS_CLASS for body in rules.values()):
        return ebnf

    def inline(m: re.Match) -> str:
        if m.group(1) is None or m.group(1) not in rules:
            return m.group(0)
        n = int(m.group(2))
        return "(" + " | ".join(['""'] + [" ".join(["[ \\n\\r\\t]"] * k) for k in range(1, n + 1)]) + ")"

    return _WS_REPEAT.sub(inline, ebnf)


def _inject_whitespace(node, ws: int) -> None:
    """Bound whitespace in json_schema contents of a structural tag that do not set it."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node and "max_whitespace_cnt" not in node:
            node["max_whitespace_cnt"] = ws
        for key, value in node.items():
            if key != "json_schema":
                _inject_whitespace(value, ws)
    elif isinstance(node, list):
        for value in node:
            _inject_whitespace(value, ws)
