"""The FastAPI app: the OpenAI, Batch API, native, admin and LoRA routers, the error handlers, and the start of the
TokenizerManager and of the batch runner."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from gramserve.config import ServerConfig
from gramserve.gc_pauses import freeze_heap
from gramserve.server.admin_api import admin_router
from gramserve.server.auth import ApiKeyMiddleware, key_policy
from gramserve.server.batch.batches_api import batches_router
from gramserve.server.batch.files_api import files_router
from gramserve.server.batch.service import BatchService
from gramserve.server.batch.upload import ENVELOPE_BYTES, too_large_message
from gramserve.server.body_limit import BodyLimit, BodyLimitMiddleware
from gramserve.server.error_handlers import register_error_handlers
from gramserve.server.lora_api import lora_router
from gramserve.server.native_api import native_router
from gramserve.server.openai_api import openai_router
from gramserve.server.openai_serving import OpenAIServing
from gramserve.server.openapi import install_typed_openapi
from gramserve.server.request_id import RequestIdMiddleware
from gramserve.server.tokenizer_manager import TokenizerManager
from gramserve.server.warmup import warm_up_server


def create_app(config: ServerConfig, tm: TokenizerManager, runner_info: dict) -> FastAPI:
    args = config.args
    batches = BatchService(config, tm, OpenAIServing(tm, config))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tm.start()  # the receive loop needs the server's event loop
        freeze_heap("main process")
        warming = (
            asyncio.create_task(warm_up_server(config, tm, runner_info)) if tm.health and tm.health.warming else None
        )
        batches.start()  # its lines wait for the warm-up to end
        yield
        await batches.stop()
        if warming is not None:
            warming.cancel()

    app = FastAPI(title="gramserve", version="0.1.0", lifespan=lifespan)
    register_error_handlers(app)
    app.include_router(openai_router(config, tm, runner_info))
    app.include_router(files_router(batches, args))
    app.include_router(batches_router(batches, args))
    app.include_router(native_router(config.args, tm))
    app.include_router(admin_router(config, tm))
    app.include_router(lora_router(tm))
    install_typed_openapi(app)
    upload_limit = BodyLimit(args.max_file_bytes + ENVELOPE_BYTES, too_large_message(args.max_file_bytes))
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_request_bytes, path_limits={"/v1/files": upload_limit})
    # Added after, so it runs before: a request without its key is refused before its body is read.
    app.add_middleware(ApiKeyMiddleware, policy=key_policy(args.api_key, args.admin_api_key, args.metrics_require_key))
    if args.allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(args.allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, refusals included, has an id and a log line
    return app
