"""Incremental detokenization and stop-string filtering for streamed output.

`IncrementalDecoder` turns a growing list of token ids into text deltas without re-decoding the
whole output each step, and never emits a half-finished UTF-8 character. `StopStringFilter` cuts
the text at the first stop string and holds back any tail that might still become one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Per-request detokenizer using a sliding (prefix_offset, read_offset) window.

    Text of ids[:read_offset] has been emitted. Each step decodes ids[prefix_offset:] and
    ids[prefix_offset:read_offset] and emits the difference: decoding from a few tokens back
    (rather than from read_offset) keeps tokenizers that treat a leading token specially (e.g.
    SentencePiece's leading space) consistent, while the window stays O(1) in length.

    A window whose decoding ends in U+FFFD is a character split over tokens; those ids are held
    until later tokens complete it, or until `finish=True`, which flushes everything.
    """

    # How many trailing tokens to drop when looking for a complete-character boundary inside a
    # held window (a UTF-8 character is at most 4 bytes, so a few tokens suffice).
    MAX_BACKOFF = 4
    # Safety valve against genuinely invalid byte runs growing the window without bound: past
    # this many held tokens the window is emitted as is (with U+FFFD).
    MAX_HELD_TOKENS = 32

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix_text: str | None = None  # cached decode of ids[prefix_offset:read_offset]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self.ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _advance(self, end: int, text: str, force: bool = False) -> str:
        """Emit the window's new text up to `end` and slide the window forward."""
        assert self._prefix_text is not None
        delta = text[len(self._prefix_text) :]
        if delta or force:
            self.prefix_offset = self.read_offset
            self.read_offset = end
            self._prefix_text = None
        return delta

    def decode(self, new_ids: Sequence[int], finish: bool = False) -> str:
        """Append `new_ids` and return the newly completed text (everything left when `finish`)."""
        self.ids.extend(new_ids)
        n = len(self.ids)
        if n == self.read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.prefix_offset, self.read_offset)
        if finish:
            return self._advance(n, self._decode(self.prefix_offset, n), force=True)
        # Longest window first; back off a few tokens if it ends inside a split character.
        for end in range(n, max(self.read_offset, n - self.MAX_BACKOFF), -1):
            text = self._decode(self.prefix_offset, end)
            if not text.endswith(REPLACEMENT_CHAR):
                return self._advance(end, text)
        if n - self.read_offset > self.MAX_HELD_TOKENS:
            return self._advance(n, self._decode(self.prefix_offset, n), force=True)
        return ""


class StopStringFilter:
    """Truncates streamed text at the first stop string, which never appears in the output (with `keep`, the text
    ends with it: vLLM's include_stop_str_in_output, SGLang's no_stop_trim).

    "First" means the occurrence that completes earliest in the stream (ties: the longer one),
    so the result does not depend on how the text was chunked. While streaming, the longest
    tail that is a proper prefix of some stop string is held back; it is released once it can
    no longer start a stop string, or by `flush()` at the end.
    """

    def __init__(self, stop_strs: Iterable[str] = (), keep: bool = False) -> None:
        self.stop_strs: tuple[str, ...] = tuple(s for s in dict.fromkeys(stop_strs) if s)
        self.keep = keep
        self.matched: str | None = None
        self._held = ""

    @property
    def held(self) -> str:
        return self._held

    def push(self, text: str) -> str:
        """Feed new text; return the part that is safe to emit now."""
        if self.matched is not None:
            return ""
        if not self.stop_strs:
            out, self._held = self._held + text, ""
            return out
        buf = self._held + text
        # Any occurrence must start inside buf: a prefix of it ending earlier would have been held.
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop_strs:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, s = best
            self.matched = s
            self._held = ""
            return buf[:end] if self.keep else buf[: end + neg_len]
        hold = self._partial_match_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def turn_off(self) -> None:
        """Stop matching: from the next push on, held-back text and new text pass unchanged."""
        self.stop_strs = ()

    def flush(self) -> str:
        """Release held-back text at the end of the stream (nothing after a match)."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop_strs:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
