"""The uniform interface of the grammar backends (xgrammar, llguidance, outlines-core).

A backend turns a :class:`GrammarSpec` into an opaque compiled grammar (cacheable, shareable between
requests) and makes per-request :class:`Matcher` objects from it. A matcher follows the tokens of
one generation and fills one row of a token bitmask (xgrammar's layout: int32 words, bit ``i % 32``
of word ``i // 32`` set when token ``i`` is allowed).

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
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gramserve.grammar.fill import FillPool

logger = logging.getLogger(__name__)

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
    strict_json: xgrammar only: forbid object properties and array items the schema does not
        declare (as if ``additionalProperties``/``unevaluatedItems`` were false). Default False
        follows the schema; llguidance follows the schema; outlines-core is always strict.
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
        """A message when the backend hit an internal limit/error mid-generation (only EOS is then
        allowed so that the request can end), else None."""
        return None

    @classmethod
    def fill_rows(cls, rows: Sequence[tuple["Matcher", int]], bitmask: torch.Tensor, pool: "FillPool") -> None:
        """Fill many rows of one step at once (every matcher of this class); the rows are distinct.
        Backends with a batch API override this; the result must equal ``fill_bitmask`` row by row."""
        for m, row in rows:
            m.fill_bitmask(bitmask, row)


class GrammarBackend(ABC):
    name: str = "base"

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
            raise GrammarCompileError(
                f"unknown grammar kind {spec.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}"
            )
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

    def close(self) -> None:
        """Release resources (optional)."""


# ---------------------------------------------------------------------------------------------
# Bitmask helpers


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab_size/32)] with every token allowed (like xgrammar)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


_xgr_apply = None
_xgr_apply_broken: set[str] = set()


_BIT_VALUES = [(1 << b) - (1 << 32) if b == 31 else 1 << b for b in range(32)]


def _torch_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    bits = torch.tensor(_BIT_VALUES, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device, non_blocking=True).unsqueeze(-1) & bits) != 0).reshape(bitmask.shape[0], -1)
    n = min(vocab, allowed.shape[1])
    logits[:, :n].masked_fill_(~allowed[:, :n], float("-inf"))
    if n < vocab:  # logits wider than the bitmask: the extra columns are disallowed
        logits[:, n:] = float("-inf")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits of disallowed tokens become -inf. logits [rows, V] (or [V]), bitmask
    [rows, ceil(V/32)] int32 on CPU or on the logits' device."""
    global _xgr_apply
    squeeze = logits.dim() == 1
    lg = logits.unsqueeze(0) if squeeze else logits
    bm = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    if bm.dtype != torch.int32:
        raise TypeError("the bitmask must be int32")
    if bm.shape[0] != lg.shape[0]:
        raise ValueError(f"bitmask rows {bm.shape[0]} != logits rows {lg.shape[0]}")
    dev = lg.device.type
    if dev not in _xgr_apply_broken and lg.is_contiguous() and lg.dtype in (torch.float32, torch.float16, torch.bfloat16):
        try:
            if _xgr_apply is None:
                from xgrammar import apply_token_bitmask_inplace as fn

                _xgr_apply = fn
            covered = min(lg.shape[-1], bm.shape[1] * 32)
            _xgr_apply(lg, bm.to(lg.device, non_blocking=True), vocab_size=covered)
            if covered < lg.shape[-1]:  # logits wider than the bitmask: extra columns disallowed
                lg[:, covered:] = float("-inf")
            return
        except Exception as e:  # noqa: BLE001 - e.g. no compiled kernel for this device
            logger.warning("xgrammar.apply_token_bitmask_inplace failed on %s (%s); using torch", dev, e)
            _xgr_apply_broken.add(dev)
    _torch_apply_bitmask(lg, bm)


def set_only_tokens(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Row ``row`` allows exactly ``token_ids``."""
    r = bitmask[row]
    r.zero_()
    for t in token_ids:
        w, b = divmod(int(t), 32)
        if w < r.shape[0]:
            r[w] |= _bit(b)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids: list[int], allowed: bool) -> None:
    r = bitmask[row]
    for t in token_ids:
        w, b = divmod(int(t), 32)
        if w < r.shape[0]:
            if allowed:
                r[w] |= _bit(b)
            else:
                r[w] &= ~_bit(b)


def clear_columns_from(bitmask: torch.Tensor, rows: int | Sequence[int], start: int) -> None:
    """Disallow every column >= start in one row, or in several rows at once."""
    w, b = divmod(start, 32)
    if w >= bitmask.shape[1] or (not isinstance(rows, int) and not rows):
        return
    idx = rows if isinstance(rows, int) else torch.tensor(rows, dtype=torch.long)
    if b:
        bitmask[idx, w] &= (1 << b) - 1  # keep bits below b
        w += 1
    if w < bitmask.shape[1]:
        bitmask[idx, w:] = 0


def _bit(b: int) -> int:
    """The int32 value with bit b set (bit 31 is the sign bit)."""
    return (1 << b) - (1 << 32) if b == 31 else 1 << b


def check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError("bitmask must be a 2-D int32 tensor")
    if bitmask.device.type != "cpu":
        raise ValueError("bitmask must be on the CPU")
    if bitmask.shape[1] < bitmask_words(vocab_size):
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; {bitmask_words(vocab_size)} needed")


def check_bitmask_row(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    check_bitmask(bitmask, vocab_size)
    r = bitmask[row]
    if not r.is_contiguous():
        raise ValueError("bitmask rows must be contiguous")
    return r


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


def _describe(e: BaseException) -> str:
    msg = str(e).strip()
    if not msg:
        msg = type(e).__name__
    if len(msg) > 2000:
        msg = msg[:2000] + " ..."
    return msg
