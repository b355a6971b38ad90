"""Pacing a fast engine's outputs: under load, each request's tokens go to the main process a few at a time.

Each output the main process receives wakes that request's stream, which writes one chunk through the ASGI stack:
tens of microseconds of the one event loop that also takes new requests. A 1B model at 256 streams makes one
output per stream every 2-4 ms, about 17,000 a second, and that saturated the loop: new requests then waited
0.8 s in it before reaching the scheduler, which ran a quarter full (docs/benchmarks.md, issue 20, stop 54).

`OutputPacer` holds a request's outputs back until `interval` has passed since its last one went out, where the
interval grows with the number of requests in flight (`STREAM_CHUNKS_PER_S` outputs a second in all) up to
`max_interval`. A request's outputs up to its first text (an output may hold no text yet: part of a UTF-8 character,
a possible stop string) and its last (finished) are never held, so TTFT and the end of a request do not move; with
few requests in flight the interval is shorter than a decode step and nothing is held. The main process merges the
held outputs of a request into one (`merge_outputs`).
"""

from __future__ import annotations

from gramserve.messages import BatchTextOut

STREAM_CHUNKS_PER_S = 5000.0  # outputs a second, over all requests, that the main process takes in its stride


class OutputPacer:
    def __init__(self, max_interval_s: float):
        self.max_interval = max_interval_s
        self.last_sent: dict[str, float] = {}  # rid -> when its last output went out (requests whose text began)
        self.held: dict[str, list[tuple]] = {}  # rid -> the BatchTextOut columns of its held outputs, in order
        self.due_at: dict[str, float] = {}  # rid -> when its held outputs go out

    def interval(self, streams: int) -> float:
        return min(self.max_interval, streams / STREAM_CHUNKS_PER_S)

    def push(self, out: BatchTextOut, streams: int, now: float) -> BatchTextOut | None:
        """What of `out` (and of the outputs held before) goes out now; the rest is held."""
        send: list[tuple] = []
        interval = self.interval(streams)
        for item in _items(out):
            rid, text, finished = item[0], item[1], item[3]
            last = self.last_sent.get(rid)
            if finished is not None or last is None or (rid not in self.held and now - last >= interval):
                send += self._release(rid)
                send.append(item)
                if finished is not None:
                    self.last_sent.pop(rid, None)
                elif text or last is not None:
                    self.last_sent[rid] = now
            else:
                self.held.setdefault(rid, []).append(item)
                self.due_at.setdefault(rid, last + interval)
        return _batch(send + self._due_items(now))

    def take_due(self, now: float) -> BatchTextOut | None:
        """The held outputs whose time has come."""
        return _batch(self._due_items(now))

    def _due_items(self, now: float) -> list[tuple]:
        items = []
        for rid in [r for r, t in self.due_at.items() if t <= now]:
            items += self._release(rid)
            self.last_sent[rid] = now
        return items

    def next_due(self) -> float | None:
        return min(self.due_at.values(), default=None)

    def _release(self, rid: str) -> list[tuple]:
        self.due_at.pop(rid, None)
        return self.held.pop(rid, [])


def _items(out: BatchTextOut) -> list[tuple]:
    backends = out.grammar_backends or [None] * len(out.rids)
    return list(
        zip(
            out.rids,
            out.text_deltas,
            out.new_token_ids,
            out.finished,
            out.prompt_tokens,
            out.completion_tokens,
            out.cached_tokens,
            out.logprobs,
            backends,
        )
    )


def _batch(items: list[tuple]) -> BatchTextOut | None:
    if not items:
        return None
    columns = [list(c) for c in zip(*items)]
    return BatchTextOut(*columns)
