"""Sampling parameters of one request, validated once in the main process."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TEMPERATURE = 100.0  # past it every distribution is uniform in float32; larger values only risk overflow
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024


class SamplingParamsError(ValueError):
    """A client-supplied sampling parameter is out of range; `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int | None = None  # None: up to the context length
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # the matched stop string ends the text instead of being cut (vLLM, SGLang)
    # Stop strings apply until one of these regexes matches the output: the start of a tool call, which stop strings
    # do not cut (OpenAI's `stop` ends the text answer, never a call's arguments). Empty: always.
    stop_until: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def edits_logits(self) -> bool:
        """Penalties or a logit bias: the sampler changes the model's logits before choosing."""
        return bool(
            self.logit_bias or self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        )

    @property
    def raw_argmax(self) -> bool:
        """Greedy with no penalties or logit bias: the token is the argmax of the model's own logits."""
        return self.greedy and not self.edits_logits

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise SamplingParamsError("max_tokens must be at least 1", "max_tokens")
        if self.min_new_tokens < 0:
            raise SamplingParamsError("min_tokens must be non-negative", "min_tokens")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamsError("min_tokens must not exceed max_tokens", "min_tokens")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            message = f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            raise SamplingParamsError(message, "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (disabled) or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamsError("frequency_penalty must be in [-2, 2]", "frequency_penalty")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamsError("presence_penalty must be in [-2, 2]", "presence_penalty")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError("repetition_penalty must be in (0, 2]", "repetition_penalty")
        for tok, bias in self.logit_bias.items():
            if not 0 <= tok < vocab_size:
                raise SamplingParamsError(f"logit_bias token id {tok} is outside the vocabulary", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError("logit_bias values must be in [-100, 100]", "logit_bias")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise SamplingParamsError(f"stop_token_ids entry {tok} is outside the vocabulary", "stop_token_ids")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop strings must be non-empty", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise SamplingParamsError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters", "stop")


_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice `i` of a seeded request with `n` > 1: the request's own for choice 0, a hash of (seed, i)
    for the others (splitmix64's finalizer). With `seed + i`, choice 1 of seed 7 was choice 0 of seed 8, so a sweep
    over seeds returned the same samples again."""
    if i == 0:
        return seed
    z = (seed + i * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % (1 << 63)
