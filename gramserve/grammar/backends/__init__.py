"""Grammar backends behind one interface (see ``base``): xgrammar, llguidance, outlines-core.

    backend = create_backend("xgrammar", tokenizer, vocab_size, eos_token_ids, GrammarOptions())
    compiled = backend.compile(GrammarSpec("json_schema", schema_text))   # GrammarCompileError
    m = backend.matcher(compiled)
    bitmask = allocate_bitmask(batch, vocab_size)                        # gramserve.sampling.bitmask
    m.fill_bitmask(bitmask, row); apply_bitmask(logits, bitmask); m.accept_token(token)

Backend modules are imported lazily, so a missing optional library only breaks its own backend.
"""

from __future__ import annotations

from ._vocab import vocab_bytes
from .base import (
    GRAMMAR_KINDS,
    GrammarBackend,
    GrammarCompileError,
    GrammarOptions,
    GrammarSpec,
    Matcher,
)

BACKEND_NAMES = ("xgrammar", "llguidance", "outlines")

# Which kinds each backend can compile (others raise GrammarCompileError).
SUPPORTED_KINDS = {
    "xgrammar": GRAMMAR_KINDS,
    "llguidance": GRAMMAR_KINDS,
    "outlines": ("json_schema", "json_object", "regex", "choice"),
}


def backend_class(name: str) -> type[GrammarBackend]:
    if name == "xgrammar":
        from .xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    if name == "llguidance":
        from .llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    if name in ("outlines", "outlines_core", "outlines-core"):
        from .outlines_backend import OutlinesBackend

        return OutlinesBackend
    raise ValueError(f"unknown grammar backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")


def create_backend(
    name: str,
    tokenizer,
    vocab_size: int,
    eos_token_ids: list[int],
    options: GrammarOptions | None = None,
) -> GrammarBackend:
    """Build a backend. vocab_size is the logits width (may exceed the tokenizer's vocabulary)."""
    return backend_class(name)(tokenizer, vocab_size, eos_token_ids, options or GrammarOptions())


__all__ = [
    "BACKEND_NAMES",
    "GRAMMAR_KINDS",
    "SUPPORTED_KINDS",
    "GrammarBackend",
    "GrammarCompileError",
    "GrammarOptions",
    "GrammarSpec",
    "Matcher",
    "backend_class",
    "create_backend",
    "vocab_bytes",
]
