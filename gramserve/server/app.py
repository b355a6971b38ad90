"""The FastAPI app: the OpenAI, native and admin routers, the error handlers, and the TokenizerManager's start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from gramserve.config import ServerConfig
from gramserve.server.admin_api import admin_router
from gramserve.server.auth import ApiKeyMiddleware, key_policy
from gramserve.server.body_limit import BodyLimitMiddleware
from gramserve.server.error_handlers import register_error_handlers
from gramserve.server.native_api import native_router
from gramserve.server.openai_api import openai_router
from gramserve.server.openapi import install_typed_openapi
from gramserve.server.request_id import RequestIdMiddleware
from gramserve.server.tokenizer_manager import TokenizerManager


async def _warm_up(config: ServerConfig, tm: TokenizerManager, runner_info: dict) -> None:
    from gramserve.server.warmup import warm_up, warmup_cases

    settings = config.settings
    cases = warmup_cases(
        settings.device, runner_info["context_length"], settings.chunked_prefill_size, settings.max_running_requests
    )
    try:
        await warm_up(tm, cases)
    finally:
        tm.health.warming = False


def create_app(config: ServerConfig, tm: TokenizerManager, runner_info: dict) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start()  # the receive loop needs the server's event loop
        warming = asyncio.create_task(_warm_up(config, tm, runner_info)) if tm.health and tm.health.warming else None
        yield
        if warming is not None:
            warming.cancel()

    app = FastAPI(title="gramserve", version="0.1.0", lifespan=lifespan)
    register_error_handlers(app)
    app.include_router(openai_router(config, tm, runner_info))
    app.include_router(native_router(config.args, tm))
    app.include_router(admin_router(config, tm))
    install_typed_openapi(app)
    args = config.args
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_bytes)
    # Added after, so it runs before: a request without its key is refused before its body is read.
    app.add_middleware(ApiKeyMiddleware, policy=key_policy(args.api_key, args.admin_api_key, args.metrics_require_key))
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, refusals included, has an id and a log line
    return app
