"""Server routes outside any generation API: /health, /get_server_info and /flush_cache."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gramserve.config import ServerConfig
from gramserve.server.error_handlers import error_response
from gramserve.server.tokenizer_manager import TokenizerManager


def admin_router(config: ServerConfig, tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return Response(status_code=200)

    @router.get("/get_server_info")
    async def server_info():
        info = await tm.control("server_info")
        # As given, as resolved (every `auto`), as derived at start-up; then the scheduler's live report.
        return JSONResponse(
            {
                "server_args": config.args.to_dict(),
                "settings": config.settings.to_dict(),
                "launch": config.launch.to_dict(),
                "model_name": config.args.model_name,
                "output_checks": dict(tm.output_checker.stats),
                **info,
            }
        )

    @router.post("/flush_cache")
    async def flush_cache():
        result = await tm.control("flush_cache")
        if not result.get("ok"):
            return error_response(400, result.get("error", "cannot flush the cache"))
        return JSONResponse({"ok": True, "message": "prefix cache flushed"})

    return router
