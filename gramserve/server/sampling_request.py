"""The one builder of SamplingParams, for every route: OpenAI chat and completions, and native /generate.

It owns the rules the routes share: None means the default, a stop string becomes a one-element tuple,
logit_bias keys become token ids, top_k 0 means disabled, chat's max_completion_tokens wins over max_tokens.
The params it returns are validated (SamplingParams.validate), so routes hold no unchecked SamplingParams.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gramserve.sampling.params import SamplingParams, SamplingParamsError
from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none (up to the context)

# Native sampling_params names the builder spells differently (SGLang's names -> OpenAI's).
_NATIVE_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str"}


def _token_bias(bias: dict[Any, Any] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from exc
        try:
            out[token] = float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError("logit_bias values must be numbers", "logit_bias") from exc
    return out


def build_sampling_params(
    vocab_size: int,
    *,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    logit_bias: dict[Any, float] | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool | None = None,
    skip_special_tokens: bool | None = None,
    include_stop_str: bool | None = None,
) -> SamplingParams:
    """Fields as the OpenAI API names them. Raises InvalidRequestError / SamplingParamsError (both 400s)."""
    params = SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens or 0,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k in (None, 0) or top_k >= vocab_size else top_k,  # a k past the vocabulary keeps all
        min_p=min_p or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        presence_penalty=presence_penalty or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        seed=seed,
        logit_bias=_token_bias(logit_bias),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=bool(ignore_eos),
        skip_special_tokens=True if skip_special_tokens is None else skip_special_tokens,
        include_stop_str=bool(include_stop_str),
    )
    params.validate(vocab_size)
    return params


def requested_max_tokens(req: P.SamplingFields) -> int | None:
    if isinstance(req, P.ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    if req.max_tokens is None and isinstance(req, P.CompletionRequest):
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return req.max_tokens


def _named_as_sent(exc: SamplingParamsError, names: dict[str, str]) -> SamplingParamsError:
    """The error with the request's own field names (`names`: ours -> the request's) in its param and message."""
    message = str(exc)
    for ours, theirs in names.items():
        message = message.replace(ours, theirs)
    return SamplingParamsError(message, names.get(exc.param, exc.param))


def openai_sampling_params(req: P.SamplingFields, vocab_size: int) -> SamplingParams:
    try:
        return _openai_sampling_params(req, vocab_size)
    except SamplingParamsError as exc:
        if isinstance(req, P.ChatCompletionRequest) and req.max_completion_tokens is not None:
            raise _named_as_sent(exc, {"max_tokens": "max_completion_tokens"}) from None
        raise


def _openai_sampling_params(req: P.SamplingFields, vocab_size: int) -> SamplingParams:
    return build_sampling_params(
        vocab_size,
        max_tokens=requested_max_tokens(req),
        min_tokens=req.min_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        logit_bias=req.logit_bias,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str=req.include_stop_str_in_output,
    )


def native_sampling_params(sampling_params: dict[str, Any], vocab_size: int) -> SamplingParams:
    """/generate's `sampling_params` (SGLang's names; output-constraint keys already taken out)."""
    try:
        typed = P.NativeSamplingParams.model_validate(sampling_params)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = "unknown key" if err.get("type") == "extra_forbidden" else err.get("msg")
        raise InvalidRequestError(f"sampling_params.{where}: {msg}", "sampling_params") from None
    fields = typed.model_dump(exclude_none=True, exclude={"sampling_seed"})
    fields = {_NATIVE_RENAMES.get(k, k): v for k, v in fields.items()}
    if typed.sampling_seed is not None:
        fields["seed"] = typed.sampling_seed
    try:
        return build_sampling_params(vocab_size, **fields)
    except SamplingParamsError as exc:
        raise _named_as_sent(exc, {v: k for k, v in _NATIVE_RENAMES.items()}) from None
