"""Scheduler-side state of one request: its tokens, its KV slots and how it finishes."""

from __future__ import annotations

import re
import time

from gramserve.messages import FinishReason, TokenizedGenerateReq, TokenLogprob
from gramserve.sampling.params import SamplingParams
from gramserve.sampling.sampler import SamplingRow

STOP_UNTIL_TAIL_TOKENS = 48  # the output's tail searched for a `stop_until` pattern (a call's start is short)


class Req:
    def __init__(self, msg: TokenizedGenerateReq, max_new_tokens: int, eos_ids: set[int]):
        self.rid = msg.rid
        self.origin_input_ids: list[int] = msg.input_ids
        self.params: SamplingParams = msg.sampling
        self.return_logprob = msg.return_logprob
        self.top_logprobs = msg.top_logprobs
        self.max_new_tokens = max_new_tokens
        self.eos_ids = set() if self.params.ignore_eos else eos_ids
        # Under a grammar, EOS ends the request whatever ignore_eos and min_tokens say: the grammar allows it only
        # where the output is complete, and once it accepted EOS it allows nothing but EOS again (outputs were
        # padded with EOS tokens up to min_tokens, or to max_tokens under ignore_eos).
        self.grammar_eos_ids = eos_ids if msg.grammar is not None else set()
        self.stop_token_ids = set(self.params.stop_token_ids)
        self.output_ids: list[int] = []
        self.priority = msg.priority
        self.lora_id = msg.lora_id  # 0: the base model; also the request's prefix-cache namespace
        self.lora_slot = -1  # the adapter's device pool slot while the request holds KV (admission sets it)
        self.images = msg.images  # the prompt's images (their placeholders are in input_ids)
        self.arrival = time.monotonic()
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # tokens whose K/V are in the KV cache (matched prefix + computed)
        self.prefix_len = 0  # of those, tokens shared from the prefix cache (its slots are the tree's)
        self.prefix_node = None  # the locked radix-tree node that ends the shared prefix
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted_once = False
        self.num_retractions = 0
        self.finished: FinishReason | None = None
        self.pending_logprobs: list[TokenLogprob] = []
        self.sent_tokens = 0  # output tokens already sent to the detokenizer
        self.grammar = msg.grammar
        self.grammar_backend: str | None = None  # which backend compiled it
        self.grammar_started = msg.grammar is not None and not msg.grammar.start_after
        # Its grammar is compiling: the prompt prefills meanwhile, and the logits of its last position wait on the
        # device (`saved_logits`) for the grammar's first mask (Scheduler.parked), so the compile and the prefill
        # overlap and no step is spent once the grammar is ready.
        self.grammar_pending = False
        self.saved_logits = None  # torch.Tensor [vocab] while parked
        max_stop = max((len(s) for s in self.params.stop), default=0)
        self._stop_tail_tokens = max_stop + 2
        self.stops_live = bool(self.params.stop)  # off once a `stop_until` marker appeared (a tool call began)
        # Sampled by one argmax with no per-request work at every step (no EOS ban before min_tokens, no logprobs):
        # the sampler's fast path (`Sampler.launch_greedy`).
        self.plain_greedy = self.params.raw_argmax and self.params.min_new_tokens == 0 and not self.return_logprob

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose K/V the request needs before it can sample its next token."""
        return self.origin_input_ids + self.output_ids

    @property
    def cache_namespace(self) -> int | None:
        """Prefix-cache namespace: an adapter's K/V differ from the base model's for the same tokens."""
        return self.lora_id or None

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def constrained(self) -> bool:
        """The grammar applies to the next token."""
        return self.grammar_started

    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def sampling_row(self) -> SamplingRow:
        suppress: tuple[int, ...] = ()
        # Under a grammar, EOS is the grammar's call (it may be the only token allowed).
        if len(self.output_ids) < self.params.min_new_tokens and not self.constrained:
            suppress = tuple(self.eos_ids | self.stop_token_ids)
        return SamplingRow(self.params, self.origin_input_ids, self.output_ids, suppress)

    def append_token(self, token: int, tokenizer, context_length: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.output_ids.append(token)
        n = len(self.output_ids)
        if self.grammar is not None and not self.grammar_started:
            marker = self.grammar.start_after
            # Each token is at least one character, so the last len(marker) tokens hold any marker just completed.
            tail = tokenizer.decode(self.output_ids[-len(marker) :], skip_special_tokens=False)
            self.grammar_started = marker in tail
        past_min = n >= self.params.min_new_tokens
        if self.stops_live and self.params.stop_until:
            self._check_stop_until(tokenizer)
        if past_min and (token in self.eos_ids or token in self.stop_token_ids):
            self.finished = FinishReason("stop", matched=token)
        elif token in self.grammar_eos_ids and self.grammar_started:
            self.finished = FinishReason("stop", matched=token)
        elif past_min and self.stops_live and self._tail_has_stop_string(tokenizer):
            return  # finished set by the check
        elif n >= self.max_new_tokens or self.prompt_len + n >= context_length:
            self.finished = FinishReason("length")

    @property
    def live_stop_strs(self) -> tuple[str, ...]:
        """The stop strings that apply to the text from now on (the detokenizer follows)."""
        return self.params.stop if self.stops_live else ()

    def _check_stop_until(self, tokenizer) -> None:
        tail = tokenizer.decode(self.output_ids[-STOP_UNTIL_TAIL_TOKENS:], skip_special_tokens=False)
        if any(re.search(pattern, tail) for pattern in self.params.stop_until):
            self.stops_live = False

    def _tail_has_stop_string(self, tokenizer) -> bool:
        # Each token decodes to at least one character or byte, so this many tokens cover any stop string.
        tail = tokenizer.decode(
            self.output_ids[-self._stop_tail_tokens :], skip_special_tokens=self.params.skip_special_tokens
        )
        for s in self.params.stop:
            if s in tail:
                self.finished = FinishReason("stop", matched=s)
                return True
        return False
