"""Map every token id of a Hugging Face tokenizer to the raw bytes it stands for.

Grammar engines match bytes, so each needs to know which bytes a token produces. Supported encodings:

* byte-level BPE (GPT-2 style, e.g. SmolLM2, Llama 3, Qwen): every byte is shown as one printable
  unicode character; we invert that mapping.
* SentencePiece with byte fallback (Llama 2, Mistral): ``<0xNN>`` tokens are single bytes and ``▁``
  is a space.
* anything else: the token string as UTF-8 (with ``▁`` as a space for Metaspace pre-tokenizers).

Special and control tokens (``all_special_ids`` and added tokens marked special) map to ``None``:
they never stand for text, so no grammar backend may allow them as text. EOS tokens are handled by
each backend separately.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)

BYTE_LEVEL = "byte_level"
BYTE_FALLBACK = "byte_fallback"
RAW = "raw"


def _byte_level_alphabet() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable-character table.

    Bytes that are printable and not whitespace keep their own code point; the remaining 68 bytes
    are given consecutive code points from 256 on, in increasing byte order.
    """
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    table: dict[str, int] = {chr(b): b for b in keep}
    extra = 256
    for b in range(256):
        if b not in table.values():
            table[chr(extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


@dataclass(frozen=True)
class VocabBytes:
    tokens: tuple  # tokens[i]: bytes, or None for special/unused ids
    vocab_type: str  # BYTE_LEVEL | BYTE_FALLBACK | RAW
    size: int  # number of token ids of the tokenizer (max id + 1)
    special_ids: frozenset[int]


def _backend_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return {}
    try:
        return json.loads(backend.to_str())
    except Exception:  # pragma: no cover - defensive
        return {}


def _contains_type(node, name: str) -> bool:
    if isinstance(node, dict):
        if node.get("type") == name:
            return True
        return any(_contains_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_contains_type(v, name) for v in node)
    return False


def detect_vocab_type(tokenizer, vocab: dict[str, int]) -> str:
    spec = _backend_json(tokenizer)
    decoder = spec.get("decoder")
    if _contains_type(decoder, "ByteLevel"):
        return BYTE_LEVEL
    if _contains_type(decoder, "ByteFallback") or "<0x0A>" in vocab:
        return BYTE_FALLBACK
    if decoder is None and "Ġ" in "".join(list(vocab)[:5000]):
        return BYTE_LEVEL
    return RAW


def _decode_byte_level(tok: str) -> bytes | None:
    out = bytearray()
    for ch in tok:
        b = _BYTE_LEVEL.get(ch)
        if b is None:
            return None
        out.append(b)
    return bytes(out)


def _decode_byte_fallback(tok: str) -> bytes:
    if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
        try:
            return bytes([int(tok[3:5], 16)])
        except ValueError:
            pass
    return tok.replace("\u2581", " ").encode("utf-8")


_cache: dict[int, tuple[object, VocabBytes]] = {}
_cache_lock = threading.Lock()


def vocab_bytes(tokenizer) -> VocabBytes:
    """Raw bytes of every token id (cached per tokenizer object)."""
    with _cache_lock:
        hit = _cache.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    vocab: dict[str, int] = dict(tokenizer.get_vocab())
    size = max(len(vocab), max(vocab.values()) + 1) if vocab else 0
    vtype = detect_vocab_type(tokenizer, vocab)

    special: set[int] = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    added_text: dict[int, str] = {}
    for idx, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            special.add(int(idx))
        else:
            added_text[int(idx)] = str(getattr(tok, "content", tok))

    tokens: list[bytes | None] = [None] * size
    undecodable = 0
    for tok, idx in vocab.items():
        if idx in special:
            continue
        if idx in added_text:  # added tokens are literal text, not byte-level encoded
            tokens[idx] = added_text[idx].encode("utf-8")
            continue
        if vtype == BYTE_LEVEL:
            raw = _decode_byte_level(tok)
            if raw is None:
                undecodable += 1
                raw = tok.encode("utf-8")
        elif vtype == BYTE_FALLBACK:
            raw = _decode_byte_fallback(tok)
        else:
            raw = tok.replace("\u2581", " ").encode("utf-8")
        tokens[idx] = raw if raw else None  # an empty token can never be useful text
    if undecodable:
        logger.warning("%d byte-level tokens had characters outside the byte alphabet", undecodable)
    result = VocabBytes(tuple(tokens), vtype, size, frozenset(special))
    with _cache_lock:
        _cache[id(tokenizer)] = (tokenizer, result)
    return result


def with_text_tokens(vocab: VocabBytes, tokenizer, texts: tuple[str, ...]) -> VocabBytes:
    """`vocab` where the special tokens whose content is one of `texts` stand for that text."""
    tokens = list(vocab.tokens)
    changed = False
    for idx, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        content = str(getattr(tok, "content", tok))
        if content in texts and int(idx) < len(tokens) and tokens[int(idx)] is None:
            tokens[int(idx)] = content.encode("utf-8")
            changed = True
    return replace(vocab, tokens=tuple(tokens)) if changed else vocab
