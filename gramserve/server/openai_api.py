"""The OpenAI routes: /v1/chat/completions, /v1/completions and /v1/models (the work is in openai_serving.py).

A request's `model` is the served model (or "default", or left out) or a LoRA adapter's name; else a 404
(server/lora_registry.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gramserve.config import ServerConfig
from gramserve.server import protocol as P
from gramserve.server.openai_serving import OpenAIServing
from gramserve.server.request_body import parse_body
from gramserve.server.tokenizer_manager import TokenizerManager


def openai_router(config: ServerConfig, tm: TokenizerManager, runner_info: dict) -> APIRouter:
    router = APIRouter()
    args = config.args
    serving = OpenAIServing(tm, config)

    def model_cards() -> list[P.ModelCard]:
        length = runner_info.get("context_length")
        base = P.ModelCard(id=args.model_name, root=args.model_name, max_model_len=length)
        adapters = [
            P.ModelCard(id=a.name, root=a.path, parent=args.model_name, max_model_len=length) for a in tm.lora.served
        ]
        return [base, *adapters]

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_body(request, P.ChatCompletionRequest)
        if req.stream:
            stream = await serving.chat_stream(req, request.is_disconnected)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse((await serving.chat(req, request.is_disconnected)).model_dump())

    @router.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_body(request, P.CompletionRequest)
        if req.stream:
            stream = await serving.completions_stream(req, request.is_disconnected)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse((await serving.completions(req, request.is_disconnected)).model_dump())

    @router.get("/v1/models")
    async def models():
        return JSONResponse(P.ModelList(data=model_cards()).model_dump())

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        tm.lora.adapter_for(model_id)  # a 404 for a name not served
        cards = model_cards()
        card = next((c for c in cards if c.id == model_id), cards[0])
        return JSONResponse(card.model_dump())

    return router
