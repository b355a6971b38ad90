"""Typed messages exchanged between the processes over ZeroMQ.

    TokenizerManager --TokenizedGenerateReq / AbortReq / ControlReq--> Scheduler
    Scheduler --BatchTokenOut / ControlResp--> Detokenizer
    Detokenizer --BatchTextOut / ControlResp (forwarded)--> TokenizerManager
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gramserve.sampling.params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs: int = 0
    stream: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request/response query to the scheduler (server info, pool status)."""

    qid: str
    kind: str  # "server_info"


@dataclass
class ControlResp:
    qid: str
    payload: dict[str, Any]


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # for aborts

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class BatchTokenOut:
    """New tokens of every request that advanced in one scheduler step."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[list[TokenLogprob] | None]
    # Per-request detokenization settings; resent each step (small) so the detokenizer needs no setup message.
    stop_strs: list[tuple[str, ...]]
    skip_special_tokens: list[bool]


@dataclass
class BatchTextOut:
    rids: list[str]
    text_deltas: list[str]
    new_token_ids: list[list[int]]
    finished: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[list[TokenLogprob] | None]
