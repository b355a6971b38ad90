"""SGLang's native endpoints: /generate (text or input_ids plus a sampling_params dict) and /abort_request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gramserve.config import ServerArgs
from gramserve.messages import TokenLogprob
from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError
from gramserve.server.request_body import parse_body, read_json_object
from gramserve.server.request_checks import check_native_prompt, check_prompt
from gramserve.server.sampling_request import native_sampling_params
from gramserve.server.streaming import SSE_DONE, STREAM_ERRORS_PASSED_ON, error_event, prefetch_first
from gramserve.server.structured_outputs import grammar_from_fields
from gramserve.server.tokenizer_manager import GenerateOutput, TokenizerManager

INLINE_ENCODE_CHARS = 64 * 1024

# sampling_params keys that constrain the output (structured_outputs.py reads them) rather than sample
NATIVE_GRAMMAR_KEYS = frozenset(
    {
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "choice",
        "grammar_backend",
        "response_format",
        "structured_outputs",
    }
)


def _payload(req: P.GenerateRequest, text: str, ids: list[int], out: GenerateOutput, lps: list[TokenLogprob]) -> dict:
    meta = {
        "id": req.rid,
        "finish_reason": out.finished.to_json() if out.finished else None,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "grammar_backend": out.grammar_backend,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in lps]
        meta["output_top_logprobs"] = [[[v, i] for i, v in lp.top] for lp in lps]
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def _stream(req: P.GenerateRequest, gen: AsyncIterator[GenerateOutput]) -> AsyncIterator[str]:
    """Each event carries the whole output so far, as SGLang's does."""
    text, ids, lps = "", [], []
    try:
        async for out in gen:
            text += out.text
            ids += out.token_ids
            lps += out.logprobs or []
            yield f"data: {json.dumps(_payload(req, text, ids, out, lps))}\n\n"
    except STREAM_ERRORS_PASSED_ON:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
        yield error_event(exc)
    finally:
        await gen.aclose()
    yield SSE_DONE


async def _collect(req: P.GenerateRequest, gen: AsyncIterator[GenerateOutput]) -> dict:
    text, ids, lps, last = "", [], [], None
    async for out in gen:
        text += out.text
        ids += out.token_ids
        lps += out.logprobs or []
        last = out
    return _payload(req, text, ids, last, lps)


def native_router(args: ServerArgs, tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request):
        req = await parse_body(request, P.GenerateRequest)
        check_native_prompt(req)
        if req.input_ids is not None:
            input_ids = req.input_ids
        elif len(req.text) > INLINE_ENCODE_CHARS:  # a long text is tokenized off the event loop
            input_ids = await tm.off_loop(tm.encode, req.text)
        else:
            input_ids = tm.encode(req.text)
        sampling = dict(req.sampling_params)
        grammar = grammar_from_fields({k: sampling.pop(k) for k in list(sampling) if k in NATIVE_GRAMMAR_KEYS}, args)
        params = native_sampling_params(sampling, tm.vocab_size)
        check_prompt(input_ids, params.max_new_tokens, tm.vocab_size, tm.context_length)
        gen = await prefetch_first(
            tm.generate(
                input_ids,
                params,
                rid=req.rid,
                return_logprob=req.return_logprob,
                top_logprobs=req.top_logprobs_num,
                grammar=grammar,
                priority=req.priority,
                is_disconnected=request.is_disconnected,
                retry_invalid=not req.stream,
            )
        )
        if req.stream:
            return StreamingResponse(_stream(req, gen), media_type="text/event-stream")
        return JSONResponse(await _collect(req, gen))

    @router.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json_object(request)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("rid must be a non-empty string", "rid")
        # The same answer whether or not the rid exists: the endpoint does not tell which requests run.
        await tm.abort(rid)
        return JSONResponse({"rid": rid})

    return router
