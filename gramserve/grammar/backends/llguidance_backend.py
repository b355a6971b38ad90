"""llguidance backend: json_schema, json_object, regex, ebnf (Lark, or GBNF converted with
``llguidance.gbnf_to_lark``), choice, structural_tag (xgrammar's format translated to Lark with lazy
lexemes, see ``_structural_tag``; token-level formats, dispatch and XML styles are rejected).

* The compiled grammar is a validated prototype ``LLMatcher``; each request gets a ``deep_copy``. Copies of one
  prototype share a lock, so only rows of different prototypes fill in parallel (``grammar/fill.py``):
  ``add_lanes`` compiles the grammar again, up to ``fill_lanes`` prototypes in all (the grammar service does it in
  the background after the first compile has answered), and requests take the prototypes there are in turn.
* Token slices (``TOKEN_SLICES``): llguidance adds a slice's tokens to a mask in one step when the lexer allows
  every string of the slice's regex, and walks the rest of the token trie. Its default slices (string runs of up
  to 10 and 30 characters) leave strings with a maxLength to the walk once fewer than 30 characters remain (0.2-1
  ms a row); slices of string runs 1..12, 14, 16, 20, 24, 30 characters long keep them at 20-36 us until about
  12 characters remain.
* ``LLMatcher.consume_token`` puts the matcher in a permanent error state on a bad token, so
  ``accept_token`` checks ``validate_tokens`` first. EOS is decided by ``is_accepting()``.
* If llguidance hits an internal limit mid-generation (error state), only EOS is allowed and
  ``Matcher.error()`` tells why.
* regex: ``\\d`` / ``\\w`` mean ASCII digits / word characters, as in JSON Schema patterns (which llguidance
  already reads so) and xgrammar; Rust's regex would take any Unicode digit (``ascii_classes``).
* Whitespace (GrammarOptions.max_whitespace): 0 -> no whitespace, separators "," ":"; n -> the
  whitespace pattern ``[ \\t\\n\\r]{0,n}`` at each place JSON allows whitespace; None -> any.
  Leading/trailing whitespace around the top-level value is never allowed.
* JSON Schema keywords (llguidance 1.9.1, probed): enforced: type (also lists), properties,
  required, additionalProperties, patternProperties, items, prefixItems, min/maxItems, enum, const,
  anyOf, oneOf (as anyOf when not provably disjoint, with ``coerce_one_of``), allOf, $ref/$defs
  (recursive too), pattern, min/maxLength, format (date-time, email, uri, uuid, ipv4, ...),
  minimum/maximum/exclusive* (integers and numbers), multipleOf, min/maxProperties. Rejected at
  compile time (unless ``lenient_json``, which ignores them): uniqueItems, contains, not,
  if/then/else, propertyNames, dependentRequired/dependencies, unknown formats. Valid instances
  rejected: properties out of the declared order.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance as llg
import torch

from gramserve.sampling.bitmask import bitmask_words, check_bitmask, check_bitmask_row, set_only_tokens

from ._structural_tag import map_json_schemas
from ._structural_tag import normalize as normalize_structural_tag
from ._structural_tag import to_llguidance as structural_tag_to_llguidance
from .base import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarCompileError,
    GrammarOptions,
    GrammarSpec,
    Matcher,
    ascii_classes,
    looks_like_gbnf,
    parse_choices,
    parse_json_schema,
    regex_escape,
)

if TYPE_CHECKING:
    from gramserve.grammar.fill import FillPool

logger = logging.getLogger(__name__)

# llguidance's default limits, except max_items_in_row (default 2,000: an EBNF alternation of a few thousand words
# stopped the matcher at its second token). A row of 2,500 items costs 0.3-0.7 ms a mask; a step stays bounded by
# step_max_items (50,000).
PARSER_LIMITS = llg.LLParserLimits(max_items_in_row=20_000)


class _LLGCompiled:
    __slots__ = ("grammar", "protos", "_turn")

    def __init__(self, grammar: str, proto: llg.LLMatcher):
        self.grammar = grammar
        self.protos = [proto]  # one per fill lane, compiled separately (add_lanes appends)
        self._turn = 0

    def next_lane(self) -> int:
        lane = self._turn % len(self.protos)
        self._turn += 1
        return lane


class LLGuidanceMatcher(Matcher):
    def __init__(self, m: llg.LLMatcher, eos: list[int], text_vocab: int, vocab_size: int, lane: int = 0):
        self._m = m
        self.lane = lane  # which of its grammar's prototypes it was copied from
        self._eos = eos
        self._text_vocab = text_vocab
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._terminated:
            return token_id in self._eos
        if not 0 <= token_id < self._vocab_size:
            return False
        m = self._m
        if token_id in self._eos:
            if m.is_error():
                self._terminated = True
                return True
            if not m.is_accepting():
                return False
            if token_id < self._text_vocab:
                m.consume_token(token_id)
            self._terminated = True
            return True
        if token_id >= self._text_vocab or m.is_error():
            return False
        if m.validate_tokens([token_id]) != 1:
            return False
        return m.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        r = check_bitmask_row(bitmask, row, self._vocab_size)
        if self._terminated or self._m.is_error():
            if not self._terminated:
                logger.warning("llguidance matcher error: %s", self.error())
            set_only_tokens(bitmask, row, self._eos)
            return
        self._m.unsafe_compute_mask_ptr(r.data_ptr(), self._words * 4)
        if r.shape[0] > self._words:
            r[self._words :] = 0
        if self._m.is_error():
            set_only_tokens(bitmask, row, self._eos)

    @classmethod
    def fill_rows(cls, rows: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor, pool: FillPool) -> None:
        """Row by row on one thread; on more (``FillPool.threads_for``), one ``LLExecutor`` call over the rows
        ordered by lane, so that its threads, splitting the list, mostly take rows of different prototypes
        (rows of one prototype wait on its lock). Ended or failed matchers allow only EOS."""
        key = cls.__name__
        threads = pool.threads_for(len(rows), key)
        if threads > 1:
            threads = min(threads, len({m.lane for m, _ in rows}))
        t0 = time.perf_counter()
        if threads <= 1:
            _fill_each(rows, bitmask)
        else:
            live: list[tuple[LLGuidanceMatcher, int]] = []
            words = bitmask.shape[1]
            for m, row in rows:
                # The executor writes rows of exactly the tokenizer's mask size; a wider bitmask goes row by row.
                if m._terminated or m._m.is_error() or m._words != words:
                    m.fill_bitmask(bitmask, row)
                else:
                    live.append((m, row))
            if live:
                live.sort(key=lambda item: item[0].lane)
                check_bitmask(bitmask, live[0][0]._vocab_size)
                executor = pool.executor(key, threads, llg.LLExecutor)
                executor.unsafe_compute_mask_ptr(
                    [(m._m, row) for m, row in live], bitmask.data_ptr(), words * 4, bitmask.shape[0]
                )
                for m, row in live:
                    if m._m.is_error():  # hit a limit while computing this mask
                        set_only_tokens(bitmask, row, m._eos)
        pool.record(key, len(rows), time.perf_counter() - t0, threads)

    def is_terminated(self) -> bool:
        return self._terminated

    def can_terminate(self) -> bool:
        return self._terminated or self._m.is_error() or self._m.is_accepting()

    def error(self) -> str | None:
        return _short_error(self._m.get_error()) if self._m.is_error() else None


class _BytesTokenizer:
    """For slow (non-Rust) tokenizers: llguidance's TokenizerWrapper protocol over our byte table."""

    def __init__(self, tokenizer, vocab, eos: int):
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [t if t is not None else b"" for t in vocab.tokens]
        self.special_token_ids = sorted(i for i, t in enumerate(vocab.tokens) if t is None)
        self._tok = tokenizer

    def __call__(self, s):
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tok.encode(s, add_special_tokens=False)


_STRING_RUN = r'[^"\\\x00-\x1F\x7F]'  # a character that a JSON string holds unescaped
TOKEN_SLICES = [
    r"[\x20\x0A\x0D\x09]+",
    *(f"{_STRING_RUN}{{1,{n}}}" for n in (*range(1, 13), 14, 16, 20, 24, 30)),
    f"{_STRING_RUN}+",
]


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    searches_patterns = True

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: GrammarOptions | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids, options)
        # llguidance takes only EOS ids the tokenizer has; a model config may name ids past it (a config served
        # with another family's tokenizer). The matcher still ends on those, it just never asks llguidance.
        ll_eos = [t for t in self.eos_token_ids if t < self.text_vocab_size] or self.eos_token_ids
        try:
            import llguidance.hf

            self.ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.vocab_size, eos_token=ll_eos, slices=TOKEN_SLICES
            )
        except ValueError:  # not a fast tokenizer
            wrapper = llg.TokenizerWrapper(_BytesTokenizer(tokenizer, self.vocab, ll_eos[0]))
            self.ll_tokenizer = llg.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=ll_eos, slices=TOKEN_SLICES)
        self.json_options = self._json_options()

    def _json_options(self) -> dict:
        ws = self.options.max_whitespace
        opts: dict = {}
        if ws is None:
            opts["whitespace_flexible"] = True
        elif ws <= 0:
            opts.update(whitespace_flexible=False, item_separator=",", key_separator=":")
        else:
            opts.update(whitespace_flexible=True, whitespace_pattern=f"[\\x20\\x0A\\x0D\\x09]{{0,{int(ws)}}}")
        if self.options.lenient_json:
            opts["lenient"] = True
        if self.options.coerce_one_of:
            opts["coerce_one_of"] = True
        if self.options.unicode_escapes:
            opts["json_allow_general_unicode_escapes"] = True
        return opts

    def _grammar(self, spec: GrammarSpec) -> str:
        kind, text = spec.kind, spec.text
        if kind == "json_schema":
            schema = parse_json_schema(text)
            if isinstance(schema, bool):
                if not schema:
                    raise GrammarCompileError("json_schema: the schema `false` accepts no value")
                schema = {}
            if self.options.strict_json:
                from gramserve.grammar.schema_normalize import close_objects  # imports base, like this module

                schema = close_objects(schema)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=self.json_options)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=self.json_options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(ascii_classes(text))
        if kind == "ebnf":
            if looks_like_gbnf(text):
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    text = gbnf_to_lark(text)
                except Exception as e:  # noqa: BLE001
                    raise GrammarCompileError(f"llguidance: could not convert the GBNF grammar to Lark: {e}") from None
            return llg.LLMatcher.grammar_from_lark(text)
        if kind == "choice":
            # one lexeme (a DFA), not a parser rule per choice: a row of the Earley parser holds every alternative
            # still alive, and past max_items_in_row the matcher stops mid-output (2,500 labels did)
            return llg.LLMatcher.grammar_from_regex("(" + "|".join(regex_escape(c) for c in parse_choices(text)) + ")")
        if kind == "structural_tag":
            tag = normalize_structural_tag(text)
            if self.options.strict_json:  # tool arguments closed as in json_schema (and as xgrammar's strict mode)
                from gramserve.grammar.schema_normalize import close_objects

                map_json_schemas(tag["format"], close_objects)
            return structural_tag_to_llguidance(tag, self.json_options)
        raise GrammarCompileError(f"llguidance: unsupported grammar kind {kind!r}")

    def _compile(self, spec: GrammarSpec) -> object:
        grammar = self._grammar(spec)
        proto = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if proto.is_error():
            raise GrammarCompileError(f"llguidance rejected the {spec.kind} grammar: {_short_error(proto.get_error())}")
        return _LLGCompiled(grammar, proto)

    def add_lanes(self, compiled: object) -> None:
        if isinstance(compiled, _LLGCompiled):
            while len(compiled.protos) < self.fill_lanes:
                compiled.protos.append(
                    llg.LLMatcher(self.ll_tokenizer, compiled.grammar, log_level=0, limits=PARSER_LIMITS)
                )

    def matcher(self, compiled: object) -> Matcher:
        if not isinstance(compiled, _LLGCompiled):
            raise TypeError("not a grammar compiled by the llguidance backend")
        lane = compiled.next_lane()
        m = compiled.protos[lane].deep_copy()
        return LLGuidanceMatcher(m, self.eos_token_ids, self.text_vocab_size, self.vocab_size, lane)


def _fill_each(rows: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: torch.Tensor) -> None:
    for m, row in rows:
        m.fill_bitmask(bitmask, row)


def _short_error(msg: str) -> str:
    """llguidance errors may append parser state and the whole grammar; keep the message."""
    for marker in ("\n<state>", "<state>", "\n<grammar>"):
        i = msg.find(marker)
        if i > 0:
            msg = msg[:i]
    msg = msg.strip()
    return msg if len(msg) <= 2000 else msg[:2000] + " ..."
