"""The uniform interface of the grammar backends (xgrammar, llguidance, outlines-core).

A backend turns a :class:`GrammarSpec` into an opaque compiled grammar (cacheable, shareable between
requests) and makes per-request :class:`Matcher` objects from it. A matcher follows the tokens of
one generation and fills one row of a token bitmask (``gramserve.sampling.bitmask``; xgrammar's layout:
int32 words, bit ``i % 32`` of word ``i // 32`` set when token ``i`` is allowed).

Shared semantics, whatever the backend:

* EOS (any of ``eos_token_ids``) is allowed exactly when the text so far is a complete match
  (``can_terminate()``); accepting it terminates the matcher. After termination only EOS is
  allowed (and accepting it again is a no-op that returns True).
* Special/control tokens of the tokenizer are never allowed as text, and columns from the
  tokenizer's vocabulary size up to ``vocab_size`` (the logits width) are never allowed.
* ``accept_token`` returning False leaves the matcher unchanged.
* ``compile`` raises only :class:`GrammarCompileError`, whatever the backend does (Python
  exceptions and Rust panics alike).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gramserve.grammar.fill import FillPool

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag", "choice")

# The JSON schema of "json_object": any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    # json_schema: the schema as JSON text; choice: a JSON list of strings; structural_tag: JSON
    # text of the structural tag spec (xgrammar's format); json_object: ignored; others: the
    # grammar text.
    text: str = ""


class GrammarCompileError(Exception):
    """The backend rejects the grammar; ``str(e)`` is a message fit for a user."""


@dataclass
class GrammarOptions:
    """Per-server grammar settings.

    max_whitespace: bound on the JSON whitespace allowed between two JSON tokens, for json_schema and
        json_object, and JSON schemas inside structural tags (xgrammar: only for n > 0).
        * 0: compact JSON, separators "," and ":" and no whitespace anywhere (all backends).
        * n > 0: at most n consecutive whitespace characters (space, tab, CR, LF) at each place
          JSON allows whitespace (xgrammar: ``max_whitespace_cnt``; llguidance: whitespace pattern
          ``[ \\t\\n\\r]{0,n}``; outlines: whitespace regex ``[ \\t\\n\\r]{0,n}``).
        * None: unbounded whitespace (outlines: ``[ \\t\\n\\r]*``).
    strict_json: forbid object properties (xgrammar: and array items) the schema does not
        declare (as if ``additionalProperties``/``unevaluatedItems`` were false). Default False
        follows the schema. llguidance: objects that declare properties and set none of
        additionalProperties / patternProperties / unevaluatedProperties are closed
        (``schema_normalize.close_objects``); outlines-core is always strict.
    lenient_json: llguidance only: ignore JSON Schema keywords it does not implement instead of
        rejecting the schema (the output may then violate those keywords).
    coerce_one_of: llguidance only: treat ``oneOf`` as ``anyOf`` when it cannot prove the branches
        disjoint (otherwise the schema is rejected). xgrammar and outlines always do this.
    unicode_escapes: llguidance only: allow ``\\uXXXX`` escapes in JSON strings (xgrammar always
        allows them; outlines never does). Needed to accept ``json.dumps`` output of non-ASCII text.
    compile_threads: threads xgrammar may use to compile one grammar.
    cache_limit_bytes: size bound of xgrammar's compiled-grammar cache (-1: unbounded).
    outlines_max_recursion_depth: how deep outlines unrolls recursive ``$ref`` schemas.
    text_tokens: special tokens that may stand for their own text (xgrammar and outlines), e.g. a
        tool-call marker such as Mistral's ``[TOOL_CALLS]``, so that a grammar spelling the marker
        accepts the single token the model emits for it. Other special tokens never match text.
    max_string_length / max_array_items: opt-in bounds on JSON-schema strings without maxLength (nor pattern,
        format, enum or const) and arrays without maxItems (``schema_normalize.bound_unbounded``), against outputs
        that run to max_tokens; every output stays valid under the user's schema. None: no bound.
    """

    max_whitespace: int | None = 2
    strict_json: bool = False
    lenient_json: bool = False
    coerce_one_of: bool = True
    unicode_escapes: bool = True
    text_tokens: tuple[str, ...] = ()
    compile_threads: int = 2
    cache_limit_bytes: int = 512 * 1024 * 1024
    outlines_max_recursion_depth: int = 3
    max_string_length: int | None = None
    max_array_items: int | None = None
    loop_guard: bool = False  # the grammar service bans tokens that continue exact loops (grammar/loop_guard.py)


class Matcher(ABC):
    """The grammar state of one generation."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 CPU bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once EOS was accepted."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True when EOS would be accepted now."""

    def error(self) -> str | None:
        """A message when the backend hit an internal limit/error mid-generation, else None. Only EOS is
        then allowed; the grammar worker reports the request as failed (GrammarStepResp.failed) and the
        scheduler ends it as an error, not a success."""
        return None

    @classmethod
    def fill_rows(cls, rows: Sequence[tuple["Matcher", int]], bitmask: torch.Tensor, pool: "FillPool") -> None:
        """Fill many rows of one step at once (every matcher of this class); the rows are distinct.
        Backends with a batch API override this; the result must equal ``fill_bitmask`` row by row."""
        for m, row in rows:
            m.fill_bitmask(bitmask, row)


class GrammarBackend(ABC):
    name: str = "base"
    # A JSON schema `pattern` matches anywhere in the string, as the spec says (llguidance); others match it whole.
    searches_patterns: bool = False
    # How many threads will fill rows of one compiled grammar at once (the grammar service sets it; see add_lanes).
    fill_lanes: int = 1

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: GrammarOptions | None = None):
        from ._vocab import vocab_bytes

        if not eos_token_ids:
            raise ValueError("eos_token_ids must not be empty")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.options = options or GrammarOptions()
        self.vocab = vocab_bytes(tokenizer)
        if self.options.text_tokens:
            from ._vocab import with_text_tokens

            self.vocab = with_text_tokens(self.vocab, tokenizer, self.options.text_tokens)
        # Ids below this may be text tokens; ids from here to vocab_size are always masked.
        self.text_vocab_size = min(self.vocab.size, self.vocab_size)
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"EOS token id {t} outside the vocabulary (size {self.vocab_size})")

    def compile(self, spec: GrammarSpec) -> object:
        """Compile a grammar; raises only GrammarCompileError."""
        if not isinstance(spec, GrammarSpec):
            raise GrammarCompileError(f"expected a GrammarSpec, got {type(spec).__name__}")
        if spec.kind not in GRAMMAR_KINDS:
            raise GrammarCompileError(f"unknown grammar kind {spec.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(spec.text, str):
            raise GrammarCompileError("the grammar text must be a string")
        try:
            return self._compile(spec)
        except GrammarCompileError:
            raise
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except MemoryError:
            raise GrammarCompileError(f"{self.name}: out of memory compiling the {spec.kind} grammar") from None
        except BaseException as e:  # noqa: BLE001 - Rust panics (pyo3 PanicException) are BaseExceptions
            raise GrammarCompileError(f"{self.name} could not compile the {spec.kind} grammar: {_describe(e)}") from e

    @abstractmethod
    def _compile(self, spec: GrammarSpec) -> object: ...

    @abstractmethod
    def matcher(self, compiled: object) -> Matcher: ...

    def add_lanes(self, compiled: object) -> None:
        """Make `compiled` ready for `fill_lanes` threads filling its rows at once (off the hot path: it may
        compile again). llguidance compiles the grammar once per lane, its matchers copied from one prototype
        sharing a lock; the other backends need nothing."""

    def close(self) -> None:
        """Release resources (optional)."""


# ---------------------------------------------------------------------------------------------
# Grammar text helpers


def parse_choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except ValueError as e:
        raise GrammarCompileError(f"choice: expected a JSON list of strings ({e})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarCompileError("choice: expected a non-empty JSON list of strings")
    return list(dict.fromkeys(choices))


def parse_json_schema(text: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarCompileError(f"json_schema: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarCompileError("json_schema: the schema must be a JSON object (or a boolean)")
    from gramserve.grammar.schema_normalize import declare_required  # imports this module

    return declare_required(schema)


_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_.-]*\s*::=", re.M)


def looks_like_gbnf(text: str) -> bool:
    """GBNF / xgrammar EBNF (``name ::= ...``) rather than Lark (``name: ...``)."""
    return bool(_GBNF_RULE.search(text))


def regex_escape(s: str) -> str:
    """Escape a literal for Rust-regex-like syntaxes (xgrammar, llguidance, outlines-core):
    only the metacharacters; control characters as \\x{..} / \\u{..} escapes."""
    out = []
    for ch in s:
        if ch in "\\.+*?()|[]{}^$":
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


_ASCII_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
_ASCII_INSIDE = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(pattern: str) -> str:
    """``\\d`` and ``\\w`` (and their negations) as the ASCII classes they are in JSON Schema's ECMAScript
    regexes and in xgrammar, for regex engines where they are Unicode classes (Rust's: llguidance's regex
    grammars would otherwise let a model write any of 700 Unicode digits for ``\\d``)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            table = _ASCII_INSIDE if in_class else _ASCII_OUTSIDE
            out.append(table.get(nxt, ch + nxt))
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            if pattern[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if pattern[i + 1 : i + 2] == "]":  # a leading ] is a literal
                out.append("]")
                i += 1
        elif ch == "]" and in_class:
            in_class = False
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _describe(e: BaseException) -> str:
    msg = str(e).strip()
    if not msg:
        msg = type(e).__name__
    if len(msg) > 2000:
        msg = msg[:2000] + " ..."
    return msg
