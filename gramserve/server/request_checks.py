"""Request rules that are not types (pydantic checks those) and not sampling ranges (sampling_request.py):
each is checked once, before anything reaches TokenizerManager.generate, which trusts what it is given.

Output constraints are checked where they are parsed (structured_outputs.py), tools in tool_requests.py.
"""

from __future__ import annotations

from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI


def check_openai_options(req: P.SamplingFields, max_n: int) -> None:
    if not 1 <= req.n <= max_n:
        raise InvalidRequestError(f"n must be between 1 and {max_n}, got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")


def chat_top_logprobs(req: P.ChatCompletionRequest) -> int | None:
    """How many top logprobs per token to return; None when logprobs are off."""
    if req.logprobs:
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        return top
    if req.top_logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    return None


def check_chat_messages(req: P.ChatCompletionRequest) -> None:
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", "messages")


def check_text_output(req: P.ChatCompletionRequest) -> None:
    """Only text is written: a request for audio output (OpenAI's `modalities`, `audio`) is refused, not answered
    as text with a 200."""
    extra = req.model_extra or {}
    modalities = extra.get("modalities")
    asked = modalities if isinstance(modalities, (list, tuple)) else [modalities]
    if extra.get("audio") is not None or "audio" in asked:
        raise InvalidRequestError("this model answers in text only: audio output is not served", "modalities")


def check_completion_options(req: P.CompletionRequest) -> None:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}] for completions", "logprobs")
    if req.best_of is not None and req.best_of < req.n:
        raise InvalidRequestError(f"best_of must be greater than or equal to n, got {req.best_of} < {req.n}", "best_of")
    if req.best_of is not None and req.best_of > req.n:
        raise InvalidRequestError("best_of greater than n is not supported (ask for n samples instead)", "best_of")
    if req.echo:
        raise InvalidRequestError("echo is not supported", "echo")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", "suffix")


def check_native_prompt(req: P.GenerateRequest) -> None:
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("give exactly one of text or input_ids", "text")
    if req.return_logprob and req.logprob_start_len >= 0:
        raise InvalidRequestError(
            "logprobs of the prompt's tokens (logprob_start_len) are not served; only the output's", "logprob_start_len"
        )


def check_prompt(
    input_ids: list[int], max_new_tokens: int | None, vocab_size: int, context_length: int, param: str = "messages"
) -> None:
    """The prompt the engine will run: non-empty, ids inside the vocabulary, and room for the completion. `param`:
    the request field that holds the prompt."""
    n = len(input_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not (0 <= t < vocab_size) for t in input_ids):
        raise InvalidRequestError("prompt token ids must be within the vocabulary", "prompt")
    if n >= context_length:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, your prompt has {n} tokens.",
            param,
        )
    if max_new_tokens is not None and n + max_new_tokens > context_length:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{n + max_new_tokens} tokens ({n} in the prompt, {max_new_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
        )
