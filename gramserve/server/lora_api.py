"""LoRA adapters at run time: POST /load_lora_adapter and POST /unload_lora_adapter (vLLM's and SGLang's routes).

Both need --enable-lora, and take the admin key when one is set (server/auth.py): a load makes the server read a
folder of its own disk. The work is in lora_registry.py.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gramserve.server import protocol as P
from gramserve.server.request_body import parse_body
from gramserve.server.tokenizer_manager import TokenizerManager


def lora_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    registry = tm.lora

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = await parse_body(request, P.LoadLoRARequest)
        result = await registry.load(req.lora_name, req.lora_path)
        message = f"LoRA adapter `{req.lora_name}` loaded (rank {result.get('rank')})"
        answer = P.LoRAAdapterResponse(lora_name=req.lora_name, message=message, loaded_adapters=registry.names)
        return JSONResponse(answer.model_dump())

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = await parse_body(request, P.UnloadLoRARequest)
        await registry.unload(req.lora_name)
        message = f"LoRA adapter `{req.lora_name}` unloaded"
        answer = P.LoRAAdapterResponse(lora_name=req.lora_name, message=message, loaded_adapters=registry.names)
        return JSONResponse(answer.model_dump())

    return router
