"""Server routes outside any generation API: /health, /get_server_info and /flush_cache."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gramserve.config import ServerConfig
from gramserve.server.error_handlers import error_response
from gramserve.server.metrics import CONTENT_TYPE, exposition
from gramserve.server.tokenizer_manager import TokenizerManager

# Local paths and IPC names stay inside the server: a client sees a path's last part at most.
_PATH_ARGS = ("model_path", "tokenizer_path", "grammar_cache_dir", "chat_template")
_PRIVATE_LAUNCH = ("ipc_dir", "grammar_shm", "tokenizer_dir")
_SECRET_ARGS = ("api_key", "admin_api_key")
METRICS_SCHEDULER_TIMEOUT_S = 2.0


def _last_part(value):
    return os.path.basename(os.path.normpath(value)) if isinstance(value, str) and value else value


def public_config(config: ServerConfig) -> dict:
    args = config.args.to_dict()
    args.update({k: _last_part(args[k]) for k in _PATH_ARGS if k in args})
    args.update({k: "(set)" for k in _SECRET_ARGS if args.get(k)})
    launch = {k: v for k, v in config.launch.to_dict().items() if k not in _PRIVATE_LAUNCH}
    return {"server_args": args, "settings": config.settings.to_dict(), "launch": launch}


def admin_router(config: ServerConfig, tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.head("/health", include_in_schema=False)  # load balancers' probes; the schema documents GET
    @router.get("/health")
    async def health():
        problem = tm.health.problem() if tm.health is not None else None
        if problem is not None:
            return error_response(503, problem, err_type="service_unavailable")
        return Response(status_code=200)

    @router.get("/get_server_info")
    async def server_info():
        info = await tm.control("server_info")
        if isinstance(info.get("runner"), dict):
            info["runner"]["model_path"] = _last_part(info["runner"].get("model_path"))
        # As given, as resolved (every `auto`), as derived at start-up; then the scheduler's live report.
        return JSONResponse(
            {
                **public_config(config),
                "model_name": config.args.model_name,
                "output_checks": dict(tm.output_checker.stats),
                **info,
            }
        )

    @router.get("/metrics")
    async def metrics():
        """Prometheus text format (server/metrics.py); the scheduler's part is left out while it does not answer."""
        try:
            info = await tm.control("server_info", timeout=METRICS_SCHEDULER_TIMEOUT_S)
        except asyncio.TimeoutError:
            info = {}
        if tm.metrics is None:
            return error_response(404, "metrics are off on this server", err_type="not_found_error")
        body = exposition(tm.metrics, info, dict(tm.output_checker.stats))
        return Response(content=body, media_type=CONTENT_TYPE)

    @router.post("/flush_cache")
    async def flush_cache():
        result = await tm.control("flush_cache")
        if not result.get("ok"):
            return error_response(400, result.get("error", "cannot flush the cache"))
        return JSONResponse({"ok": True, "message": "prefix cache flushed"})

    return router
