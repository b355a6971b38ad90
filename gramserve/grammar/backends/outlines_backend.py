"""outlines-core backend: json_schema, json_object, regex, choice (all compiled to one regex DFA
``Index`` over the vocabulary). ebnf and structural_tag are rejected ("not supported by
outlines-core").

* The ``Vocabulary`` is built from the local tokenizer (raw bytes of each token, see ``_vocab``);
  special tokens and EOS are left out (``Vocabulary.from_pretrained`` is never used: it downloads).
  EOS ids are handled here: allowed exactly when the match is complete.
* outlines-core 0.2.14 drops transitions out of an accepting DFA state into a longer match that
  passes through non-accepting states (regex ``a(bc)?``: after "a" the token "b" is refused). We
  avoid accepting states inside the match: the regex becomes ``(?:R)`` + a sentinel string of
  private-use characters spelled by one otherwise unused token id (a special token or a padding
  column), and "EOS allowed" means "the sentinel token is allowed". The sentinel bit is never
  shown in the mask. Not for JSON objects/arrays: they end with a bracket, so the bug cannot occur,
  and the sentinel makes some big JSON indexes 20x slower to build. So that text tokens can never
  spell the sentinel, tokens ending with a prefix of it are left out of the vocabulary (for
  SmolLM2 only the lone byte 0xF3: characters U+C0000..U+FFFFF, unassigned or private-use, cannot
  be generated with this backend).
* Compiling is the expensive part (DFA x vocabulary); a matcher is a cheap ``Guide`` over the Index.
* Whitespace (GrammarOptions.max_whitespace): 0 -> none (compact JSON); n -> the regex
  ``[ \\t\\n\\r]{0,n}`` at each place JSON allows whitespace; None -> ``[ \\t\\n\\r]*``.
* JSON Schema keywords (outlines-core 0.2.14 ``build_regex_from_schema``, probed): enforced: type
  (also lists), properties, required, additionalProperties (false or a schema), items,
  prefixItems, min/maxItems, enum, const, anyOf, oneOf (disjoint branches), $ref/$defs (recursion
  unrolled to ``outlines_max_recursion_depth``), pattern, min/maxLength, format (date-time, date,
  time, email, uri, uuid). Ignored (invalid instances accepted): minimum/maximum on integers,
  multipleOf, uniqueItems, contains, not, propertyNames, dependentRequired, partly maxProperties.
  Valid instances rejected: undeclared properties (always strict), properties out of the declared
  order, number minimum/maximum, allOf, overlapping oneOf, ``\\uXXXX`` escapes and characters
  0x7F-0x9F in strings (so ``json.dumps`` output of non-ASCII text). Compile errors:
  patternProperties, if/then/else, many formats (ipv4, ...), schemas ``false``, patterns
  anchored at one end only (``$`` is kept inside the regex). Object/enum keys
  with regex metacharacters such as ``$`` are not escaped by outlines-core (compile error).
  Compiling can take many seconds (DFA x vocabulary) and cannot be interrupted.
"""

from __future__ import annotations

import json
import logging

import outlines_core as oc
import torch
from outlines_core.json_schema import build_regex_from_schema

from gramserve.sampling.bitmask import bitmask_words, check_bitmask_row, set_only_tokens, set_token_bits

from .base import (
    JSON_OBJECT_SCHEMA,
    GrammarBackend,
    GrammarCompileError,
    GrammarOptions,
    GrammarSpec,
    Matcher,
    parse_choices,
    parse_json_schema,
    regex_escape,
)

logger = logging.getLogger(__name__)


# Private-use code points: no model writes this, and it only matters at the very end of a match.
_SENTINEL = "\U000f0000\U0010fffd\U000f0001"


class _OutlinesCompiled:
    __slots__ = ("regex", "index", "sentinel")

    def __init__(self, regex: str, index: oc.Index, sentinel: int | None):
        self.regex = regex
        self.index = index
        self.sentinel = sentinel  # token id standing for "end of match", or None


class OutlinesMatcher(Matcher):
    def __init__(self, compiled: _OutlinesCompiled, eos: list[int], text_vocab: int, vocab_size: int):
        self._index = compiled.index
        self._sentinel = compiled.sentinel
        self._g = oc.Guide(compiled.index, max_rollback=0)
        self._eos = eos
        self._eos_set = frozenset(eos)
        self._text_vocab = text_vocab
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._terminated:
            return token_id in self._eos_set
        if token_id in self._eos_set:
            if self._complete():
                self._terminated = True
                return True
            return False
        if not 0 <= token_id < self._text_vocab or token_id == self._sentinel:
            return False  # (excluded ids are unknown to the index: advance() refuses them)
        try:
            self._g.advance(token_id, return_tokens=False)
        except ValueError:  # no transition: the state is unchanged
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        r = check_bitmask_row(bitmask, row, self._vocab_size)
        if self._terminated:
            set_only_tokens(bitmask, row, self._eos)
            return
        self._g.write_mask_into(r.data_ptr(), self._words, 4)
        if r.shape[0] > self._words:
            r[self._words :] = 0
        if self._sentinel is not None:
            set_token_bits(bitmask, row, [self._sentinel], False)
        # The index knows a single EOS id; we decide all of them.
        set_token_bits(bitmask, row, self._eos, self._complete())

    def _complete(self) -> bool:
        state = self._g.get_state()
        if self._index.is_final_state(state):
            return True
        return self._sentinel is not None and self._index.get_next_state(state, self._sentinel) is not None

    def is_terminated(self) -> bool:
        return self._terminated

    def can_terminate(self) -> bool:
        return self._terminated or self._complete()


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], options: GrammarOptions | None = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids, options)
        eos = set(self.eos_token_ids)
        # An id that is never text nor EOS carries the end-of-match sentinel (see the docstring).
        unused = [
            i
            for i in range(self.vocab_size)
            if i not in eos and (i >= self.text_vocab_size or self.vocab.tokens[i] is None)
        ]
        self.sentinel = unused[0] if unused else None
        sentinel = _SENTINEL.encode("utf-8")
        by_bytes: dict[bytes, list[int]] = {}
        self.excluded_ids: list[int] = []
        for idx, tok in enumerate(self.vocab.tokens[: self.text_vocab_size]):
            if tok is None or idx in eos:
                continue
            if self.sentinel is not None and _could_spell(tok, sentinel):
                self.excluded_ids.append(idx)
                continue
            by_bytes.setdefault(tok, []).append(idx)
        if self.sentinel is not None:
            by_bytes[sentinel] = [self.sentinel]
        self.oc_vocab = oc.Vocabulary(self.eos_token_ids[0], by_bytes)
        ws = self.options.max_whitespace
        if ws is None:
            self.whitespace = r"[ \t\n\r]*"
        elif ws <= 0:
            self.whitespace = ""
        else:
            self.whitespace = rf"[ \t\n\r]{{0,{int(ws)}}}"

    def _regex(self, spec: GrammarSpec) -> tuple[str, bool]:
        """(regex, whether matches may be extended past an accepting state, i.e. need the sentinel)."""
        kind, text = spec.kind, spec.text
        if kind in ("json_schema", "json_object"):
            if kind == "json_object":
                schema = json.loads(JSON_OBJECT_SCHEMA)
            else:
                schema = parse_json_schema(text)
                if isinstance(schema, bool):
                    if not schema:
                        raise GrammarCompileError("json_schema: the schema `false` accepts no value")
                    schema = {}
            regex = build_regex_from_schema(
                json.dumps(schema),
                whitespace_pattern=self.whitespace,
                max_recursion_depth=self.options.outlines_max_recursion_depth,
            )
            return regex, not (isinstance(schema, dict) and schema.get("type") in ("object", "array"))
        if kind == "regex":
            return _without_outer_anchors(text), True
        if kind == "choice":
            return "(" + "|".join(regex_escape(c) for c in parse_choices(text)) + ")", True
        if kind in ("ebnf", "structural_tag"):
            raise GrammarCompileError(
                f"{kind} grammars are not supported by outlines-core; use the xgrammar or llguidance backend"
            )
        raise GrammarCompileError(f"outlines: unsupported grammar kind {kind!r}")

    def _compile(self, spec: GrammarSpec) -> object:
        regex, extendable = self._regex(spec)
        sentinel = self.sentinel if extendable else None
        full = regex if sentinel is None else f"(?:{regex}){_SENTINEL}"
        try:
            index = oc.Index(full, self.oc_vocab)
        except Exception as e:  # noqa: BLE001 - ValueError mostly; show the user's regex, not ours
            shown = regex if len(regex) <= 200 else regex[:200] + "..."
            msg = str(e).replace(full, shown).replace(regex, shown)
            raise GrammarCompileError(f"outlines could not compile the {spec.kind} grammar: {msg}") from e
        return _OutlinesCompiled(regex, index, sentinel)

    def matcher(self, compiled: object) -> Matcher:
        if not isinstance(compiled, _OutlinesCompiled):
            raise TypeError("not a grammar compiled by the outlines backend")
        return OutlinesMatcher(compiled, self.eos_token_ids, self.text_vocab_size, self.vocab_size)


def _could_spell(tok: bytes, sentinel: bytes) -> bool:
    """True if the token contains the sentinel or ends with a prefix of it."""
    if sentinel in tok:
        return True
    return any(tok[-k:] == sentinel[:k] for k in range(1, min(len(tok), len(sentinel)) + 1))


def _without_outer_anchors(regex: str) -> str:
    """The regex without a leading ``^`` and a trailing unescaped ``$``: the output matches it whole anyway, and
    outlines-core refuses them ("anchored universal start state doesn't exist") where the other backends read them.
    """
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex) - 1 - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            regex = regex[:-1]
    return regex
