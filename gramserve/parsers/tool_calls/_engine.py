"""The streaming engine shared by all tool-call parsers (one instance per response).

The text is scanned left to right: free text up to the next region start is content; a region is
re-read from its start (``_parse_region``) each time text arrives until it is done or invalid.
In streaming mode call names and argument prefixes are emitted as soon as the snapshots show them;
in transactional mode (one-shot ``parse``) a region's calls count only once it is done. An invalid
region (nothing of it emitted yet) gives back its first character as text and scanning resumes
after it. At the end of the text a partial region whose calls are all complete is accepted (a
missing closing marker is forgiven); one with an incomplete call is invalid, unless the text was cut (max_tokens,
an abort): then the cut region, or a cut start marker, is dropped rather than given back as text.

``completed`` lists the calls whose arguments are complete, in order, in both modes.
"""

from __future__ import annotations

from .._text import ContentEmitter
from .base import CallSnapshot, Region, StreamDelta, ToolCall, ToolCallDelta


class Engine:
    def __init__(self, parser, transactional: bool) -> None:
        self.p = parser
        self.transactional = transactional
        self.text = ""
        self.pos = 0
        self.region: int | None = None
        self.sent: list[list[int]] = []  # per call of the current region: [index, args chars sent, done]
        self.n_calls = 0
        self.content = ContentEmitter()
        self.completed: list[ToolCall] = []
        self.finished = False

    def run(self, delta: str, final: bool, cut: bool = False) -> StreamDelta:
        if self.finished:
            return StreamDelta()
        self.text += delta
        text = self.text
        out: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self.region is None:
                found = self.p._find_region(text, self.pos)
                if found is None:
                    out.append(self.content.push(text[self.pos :]))
                    self.pos = len(text)
                    break
                i, definite = found
                out.append(self.content.push(text[self.pos : i]))
                self.pos = i
                if not definite:
                    if not final:
                        break
                    if cut:  # the text ends in the middle of a call marker
                        self.pos = len(text)
                        break
                    out.append(self.content.push(text[i]))
                    self.pos = i + 1
                    continue
                self.region = i
                self.sent = []
                continue
            r = self._read_region(final, cut)
            if r.status == "partial" and final:  # cut in the middle of a call: drop it
                self.region, self.pos = None, len(text)
                break
            if r.status == "done" or (r.status == "partial" and not self.transactional):
                self._sync(r.calls, calls)
            if r.status == "partial":
                break
            start = self.region
            self.region = None
            if r.status == "done":
                self.pos = max(r.end, start + 1)
            elif self.sent:  # streaming: part of this call was emitted; it cannot be taken back
                self.pos = len(text) if final else max(r.end, start + 1)
            else:
                out.append(self.content.push(text[start]))
                self.pos = start + 1
        if final:
            self.finished = True
        return StreamDelta(content="".join(out), calls=_merge(calls))

    def _read_region(self, final: bool, cut: bool = False) -> Region:
        try:
            r = self.p._parse_region(self.text, self.region)
        except Exception:  # noqa: BLE001 - a parser bug must not break the response
            r = Region("invalid", [], self.region)
        if r.status == "partial" and final:
            if r.calls and all(c.done and c.name is not None for c in r.calls):
                return Region("done", r.calls, len(self.text))
            return r if cut else Region("invalid", r.calls, r.end)
        if r.status == "done" and not (r.calls and all(c.done and c.name is not None for c in r.calls)):
            return Region("invalid", r.calls, r.end)
        return r

    def _sync(self, snaps: list[CallSnapshot], out: list[ToolCallDelta]) -> None:
        for k, snap in enumerate(snaps):
            if k >= len(self.sent):
                if snap.name is None:
                    return
                self.sent.append([self.n_calls, 0, 0])
                self.n_calls += 1
                out.append(ToolCallDelta(index=self.sent[k][0], name=snap.name, arguments=""))
            index, n, done = self.sent[k]
            if len(snap.args) > n:
                out.append(ToolCallDelta(index=index, arguments=snap.args[n:]))
                self.sent[k][1] = len(snap.args)
            if snap.done and not done and (self.transactional or snap.name is not None):
                self.sent[k][2] = 1
                self.completed.append(ToolCall(name=snap.name, arguments=snap.args))


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and d.name is None and merged[-1].index == d.index and merged[-1].name is None:
            merged[-1].arguments += d.arguments
        else:
            merged.append(d)
    return merged
