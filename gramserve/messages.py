"""Typed messages exchanged between the processes over ZeroMQ.

TokenizerManager --TokenizedGenerateReq / AbortReq / ControlReq--> Scheduler
Scheduler --BatchTokenOut / ControlResp--> Detokenizer
Detokenizer --BatchTextOut / ControlResp (forwarded)--> TokenizerManager
Scheduler --GrammarCompileReq / GrammarStepReq--> grammar worker
grammar worker --GrammarCompileResp / GrammarStepResp--> Scheduler
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gramserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class GrammarRequest:
    """A request's output constraint, as the client gave it (normalized)."""

    kind: str  # json_schema | json_object | regex | ebnf | structural_tag | choice
    text: str  # schema / grammar / regex text; for choice a JSON list of strings
    backend: str = "auto"  # xgrammar | llguidance | outlines | auto
    # The constraint starts only once the output text contains this marker (a reasoning model's end of
    # thinking, e.g. "</think>"); matched on text, so any tokenization of the marker counts.
    start_after: str = ""
    # The request field it came from (errors name it); not part of the grammar's identity.
    param: str = field(default="response_format", compare=False)


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, processed in the main process (multimodal/processors.py)."""

    pixels: Any  # numpy uint8 [S, S, C], resized and cropped (a quarter of the bytes of normalised floats)
    digest: int  # 64 bits of the pixels' SHA-256: the vision-feature cache key (its placeholders carry it too)
    offset: int  # its first placeholder token in input_ids
    length: int  # its placeholder tokens
    normalization: tuple = (1 / 255, (0.0,), (1.0,))  # (rescale, mean, std): the vision tower's input is
    # (pixels * rescale - mean) / std per channel, computed by the scheduler on its device


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    top_logprobs: int = 0
    grammar: GrammarRequest | None = None
    priority: int = 0  # lower runs first
    lora_id: int = 0  # the LoRA adapter (ids from the main process's registry); 0: the base model
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in order (vision-language models)
    replica: int = -1  # data parallelism: the replica that must run it (the warm-up's); -1: the controller picks


@dataclass
class GrammarCompileReq:
    rid: str | None  # None: a prefetch (no request waits for it yet)
    grammar: GrammarRequest


@dataclass
class GrammarPrefetchReq:
    """Main process -> scheduler: a request with this grammar follows once its prompt is templated and tokenized;
    its compile may start now."""

    grammar: GrammarRequest


@dataclass
class GrammarCompileResp:
    rid: str
    backend: str | None  # the backend that compiled it; None on failure
    error: str | None = None
    compile_ms: float = 0.0  # the compile's own time (for "shared": the compile it waited for)
    # "compiled": this request's compile ran; "shared": it waited for a compile of the same grammar already running;
    # "cache": the compiled grammar was in memory; "disk": loaded from the disk cache (grammar/disk_cache.py)
    source: str = "compiled"
    # `auto`: the measured mask fill cost (us per row) of each backend tried, for the log and the stats
    fill_probe_us: dict[str, float] = field(default_factory=dict)


@dataclass
class GrammarStepReq:
    """Accept last step's tokens, then fill the bitmask rows of this step's constrained requests."""

    step: int
    accept: list[tuple[str, int]]
    fill: list[tuple[str, int]]  # (rid, bitmask row): a row belongs to one request while it runs
    free: list[str]
    # After answering, the grammar worker polls for the next step without sleeping for this long (GPU serving:
    # waking a sleeping process costs more than a small batch's whole fill on some hosts).
    busy_poll_ms: float = 0.0
    # (rid, position): accepted, after `accept`, from this step's ids in the token feed (grammar/token_feed.py),
    # which the sampler writes there; the grammar worker waits for them.
    fed: list[tuple[str, int]] = field(default_factory=list)
    # Fill and feed the same rows as the last step this worker was sent with `fed` (steady decode: the scheduler
    # does not send the same rows again); `fill` and `fed` are then empty.
    repeat_fed: bool = False


@dataclass
class GrammarStepResp:
    step: int
    rejected: list[str]  # requests whose accepted token the grammar refused
    fill_ms: float = 0.0
    # requests whose matcher failed while filling (a backend limit, e.g. llguidance's "too many expressions"): rid ->
    # the backend's message; their masks allow only EOS, so they must not end as a success
    failed: dict[str, str] = field(default_factory=dict)
    shard: int = 0  # the grammar worker that answered (answers of one shard come in step order)
    loop_bans: int = 0  # rows whose mask the loop guard narrowed this step (grammar/loop_guard.py)
    shared_fills: int = 0  # rows that copied the mask of a row in the same matcher state (grammar/shared_fills.py)
    empty: list[str] = field(default_factory=list)  # requests whose grammar allows no first token (accepts nothing)


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request/response query to the scheduler: its live report, emptying the prefix cache, loading or unloading a
    LoRA adapter."""

    qid: str
    kind: str  # "server_info" | "flush_cache" | "load_lora" | "unload_lora"
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlResp:
    qid: str
    payload: dict[str, Any]
    replica: int = 0  # data parallelism: the replica that answers


@dataclass
class ReplicaFinished:
    """Data parallelism: a replica's scheduler tells the controller which requests ended (so that it knows each
    replica's load, and which requests to fail should the replica die)."""

    replica: int
    rids: list[str]


@dataclass
class ReplicaDown:
    """Data parallelism: the main process tells the controller that a replica's process died."""

    replica: int
    reason: str


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # for aborts
    status_code: int | None = None  # for aborts that are the client's fault (e.g. 400 for a bad grammar)

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
    grammar_backends: list[str | None] = field(default_factory=list)
    include_stop_strs: list[bool] = field(default_factory=list)  # empty: none keeps its stop string

    @classmethod
    def aborted(cls, rids: list[str], message: str, status_code: int) -> BatchTokenOut:
        """The output that ends these requests with an abort, no token produced (a failed arrival, a dead replica)."""
        n = len(rids)
        return cls(
            rids=list(rids),
            new_token_ids=[[] for _ in rids],
            finished=[FinishReason("abort", message=message, status_code=status_code) for _ in rids],
            prompt_tokens=[0] * n,
            completion_tokens=[0] * n,
            cached_tokens=[0] * n,
            logprobs=[None] * n,
            stop_strs=[()] * n,
            skip_special_tokens=[True] * n,
            grammar_backends=[None] * n,
        )


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
    grammar_backends: list[str | None] = field(default_factory=list)
