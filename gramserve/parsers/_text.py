"""Streamed-text helpers: a whitespace-trimming emitter and partial-marker detection."""

from __future__ import annotations


class ContentEmitter:
    """Emits text with leading/trailing whitespace of the whole stream removed (``str.strip``)."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def push(self, s: str) -> str:
        if not s:
            return ""
        combined = self.pending + s
        body = combined.rstrip()
        if not body:
            self.pending = combined if self.started else ""
            return ""
        self.pending = combined[len(body) :]
        if not self.started:
            self.started = True
            body = body.lstrip()
        return body


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
