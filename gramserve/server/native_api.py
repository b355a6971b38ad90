"""SGLang's native endpoints: /generate (text or input_ids plus a sampling_params dict, or a batch of them) and
/abort_request."""

from __future__ import annotations

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
        reqs, many = split_generate(await parse_body(request, P.GenerateRequest), args.max_n)
        watch = request.is_disconnected
        if reqs[0].stream:
            if many:
                payloads = await serving.generate_many_stream(reqs, watch)
            else:
                payloads = await serving.generate_stream(reqs[0], watch)
            return StreamingResponse(sse_stream(payloads), media_type="text/event-stream")
        if many:
            return JSONResponse(await serving.generate_many(reqs, watch))
        return JSONResponse(await serving.generate(reqs[0], watch))

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
