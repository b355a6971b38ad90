"""SGLang's native endpoints: /generate (text or input_ids plus a sampling_params dict, or a batch of them) and
/abort_request."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gramserve.config import ServerArgs
from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError
from gramserve.server.native_batch import split_generate
from gramserve.server.native_serving import NativeServing
from gramserve.server.request_body import parse_body, read_json_object
from gramserve.server.streaming import sse_stream
from gramserve.server.tokenizer_manager import TokenizerManager


def native_router(args: ServerArgs, tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    serving = NativeServing(args, tm)

    @router.post("/generate")
    async def generate(request: Request):
        req = await parse_body(request, P.GenerateRequest)
        reqs, many = split_generate(req, args.max_n, args.max_queued_requests)
        watch = request.is_disconnected
        # From before the requests are queued: an abort by the client's rid reaches them while they wait.
        group = _group(req, reqs)
        if not reqs[0].stream:
            with group:
                if many:
                    return JSONResponse(await serving.generate_many(reqs, watch))
                return JSONResponse(await serving.generate(reqs[0], watch))
        try:
            if many:
                payloads = await serving.generate_many_stream(reqs, watch)
            else:
                payloads = await serving.generate_stream(reqs[0], watch)
        except BaseException:
            group.close()
            raise
        return StreamingResponse(_closing(group, sse_stream(payloads)), media_type="text/event-stream")

    def _group(req: P.GenerateRequest, reqs: list[P.GenerateRequest]) -> contextlib.ExitStack:
        """/abort_request with a rid the client gave aborts every request split from it (n > 1, a batch)."""
        stack = contextlib.ExitStack()
        given = [req.rid] if isinstance(req.rid, str) else req.rid or []
        for rid in given:
            members = [r.rid for r in reqs if r.rid.startswith(rid + "-")]
            if members:
                stack.enter_context(tm.rid_group(rid, members))
        return stack

    async def _closing(group: contextlib.ExitStack, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        with group:
            async for chunk in stream:
                yield chunk

    @router.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json_object(request)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("rid must be a non-empty string", "rid")
        # The same answer whether or not the rid exists: the endpoint does not tell which requests run. A rid is an
        # engine request's, a /generate request's own (all its requests), or an OpenAI response's id (its choices).
        await tm.abort(rid)
        return JSONResponse({"rid": rid})

    return router
