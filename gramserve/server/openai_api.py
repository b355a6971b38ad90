"""The OpenAI routes: /v1/chat/completions, /v1/completions and /v1/models (the work is in openai_serving.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gramserve.config import ServerArgs, ServerConfig
from gramserve.server import protocol as P
from gramserve.server.errors import ModelNotServedError
from gramserve.server.openai_serving import OpenAIServing
from gramserve.server.request_body import parse_body
from gramserve.server.tokenizer_manager import TokenizerManager


def check_model(args: ServerArgs, name: str | None) -> None:
    """A request's `model` must be the served one (or "default", or left out); else a 404."""
    if name is not None and name not in (args.model_name, "default"):
        raise ModelNotServedError(f"The model `{name}` does not exist. This server serves `{args.model_name}`.")


def openai_router(config: ServerConfig, tm: TokenizerManager, runner_info: dict) -> APIRouter:
    router = APIRouter()
    args = config.args
    serving = OpenAIServing(tm, config)

    def model_card() -> P.ModelCard:
        return P.ModelCard(id=args.model_name, root=args.model_name, max_model_len=runner_info.get("context_length"))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(request, P.ChatCompletionRequest)
        check_model(args, req.model)
        if req.stream:
            stream = await serving.chat_stream(req, request.is_disconnected)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse((await serving.chat(req, request.is_disconnected)).model_dump())

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, P.CompletionRequest)
        check_model(args, req.model)
        if req.stream:
            stream = await serving.completions_stream(req, request.is_disconnected)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse((await serving.completions(req, request.is_disconnected)).model_dump())

    @router.get("/v1/models")
    async def models():
        return JSONResponse(P.ModelList(data=[model_card()]).model_dump())

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(args, model_id)
        return JSONResponse(model_card().model_dump())

    return router
