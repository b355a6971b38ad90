"""SGLang's batched /generate, split into single requests: a list of texts (or of id lists), with one sampling_params
dict for all or one per prompt, one rid per prompt (or one rid that each prompt's gets a suffix of), and `n` in
sampling_params for n samples of each prompt. Their answers come back as a list, in prompt order and then sample
order; a stream's payloads carry their place in that list as `index`."""

from __future__ import annotations

import uuid

from gramserve.sampling.params import choice_seed
from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError

_SEED_KEYS = ("sampling_seed", "seed")  # SGLang's name wins (native_sampling_params)


def split_generate(
    req: P.GenerateRequest, max_n: int, max_requests: int | None = None
) -> tuple[list[P.GenerateRequest], bool]:
    """The single requests of `req` (each with one prompt, one sampling_params dict and a rid), and whether the
    answer is a list (a batch of prompts, or n > 1). More than `max_requests` of them (what the waiting queue
    holds) is a 400: such a request could never be queued whole."""
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("give exactly one of text or input_ids", "text")
    key = "text" if req.text is not None else "input_ids"
    value = getattr(req, key)
    batch = isinstance(value, list) if key == "text" else bool(value) and isinstance(value[0], list)
    prompts = value if batch else [value]
    if batch and len(prompts) == 0:
        raise InvalidRequestError("the batch of prompts is empty", key)
    params = req.sampling_params
    if isinstance(params, list):
        if not batch or len(params) != len(prompts):
            raise InvalidRequestError(
                f"{len(params)} sampling_params for {len(prompts) if batch else 'one'} prompt(s)", "sampling_params"
            )
    else:
        params = [params] * len(prompts)
    rids = req.rid
    if isinstance(rids, list) and (not batch or len(rids) != len(prompts)):
        raise InvalidRequestError(f"{len(rids)} rids for {len(prompts) if batch else 'one'} prompt(s)", "rid")
    out: list[P.GenerateRequest] = []
    many = batch  # the answer is a list: a batch, or n > 1 below
    for i, (prompt, sampling) in enumerate(zip(prompts, params)):
        sampling = dict(sampling)
        n = sampling.pop("n", None)
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
            raise InvalidRequestError(f"sampling_params.n must be an integer in [1, {max_n}], got {n!r}", "n")
        many = many or n > 1
        if isinstance(rids, list):
            base = rids[i]
        elif rids is not None:
            base = f"{rids}-{i}" if len(prompts) > 1 else rids
        else:
            base = uuid.uuid4().hex
        seed_key = next((k for k in _SEED_KEYS if isinstance(sampling.get(k), int)), None)
        for j in range(n):
            one = dict(sampling)
            if seed_key is not None and j:
                one[seed_key] = choice_seed(sampling[seed_key], j)  # n samples differ, reproducibly
            rid = f"{base}-{j}" if n > 1 else base
            out.append(req.model_copy(update={key: prompt, "sampling_params": one, "rid": rid}))
    if max_requests and len(out) > max_requests:  # 0 or None: no limit
        raise InvalidRequestError(
            f"{len(prompts)} prompt(s) x n make {len(out)} requests, more than the {max_requests} the waiting queue "
            "holds (--max-queued-requests): split the batch",
            key,
        )
    if len({r.rid for r in out}) != len(out):
        raise InvalidRequestError("the batch's rids must differ (with n > 1 each gets -0, -1, ...)", "rid")
    return out, many
