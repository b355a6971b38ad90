"""The OpenAPI document (/openapi.json) with the real request and response bodies.

The generation routes read their bodies themselves (request_body.py: size, nesting and surrogate checks before
pydantic), so FastAPI sees no body parameter; this fills in each route's typed request body, its JSON (or, when
streamed, event-stream) answer, and the OpenAI error body of its 4xx / 5xx answers.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gramserve.server import protocol as P

# (path, method): (request body or None, 200 answer: a model, "object" (any JSON object), "text" or "empty";
# whether it may stream)
ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel] | str, bool]] = {
    ("/v1/chat/completions", "post"): (P.ChatCompletionRequest, P.ChatCompletionResponse, True),
    ("/v1/completions", "post"): (P.CompletionRequest, P.CompletionResponse, True),
    ("/generate", "post"): (P.GenerateRequest, "object", True),
    ("/abort_request", "post"): (P.AbortRequest, "object", False),
    ("/v1/models", "get"): (None, P.ModelList, False),
    ("/v1/models/{model_id}", "get"): (None, P.ModelCard, False),
    ("/health", "get"): (None, "empty", False),
    ("/get_server_info", "get"): (None, "object", False),
    ("/metrics", "get"): (None, "text", False),
    ("/flush_cache", "post"): (None, "object", False),
}
ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "500": "Internal error",
    "503": "Busy, stalled or shutting down",
}


def install_typed_openapi(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        models = {m for body, answer, _ in ROUTES.values() for m in (body, answer) if isinstance(m, type)}
        models.add(P.ErrorResponse)
        refs, defs = models_json_schema(
            [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
            ref_template="#/components/schemas/{model}",
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        error = {"application/json": {"schema": refs[(P.ErrorResponse, "validation")]}}
        for (path, method), (body, answer, streams) in ROUTES.items():
            op = doc["paths"].get(path, {}).get(method)
            if op is None:
                continue
            if body is not None:
                schema = refs[(body, "validation")]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
            if answer == "empty":
                ok: dict = {}
            elif answer == "text":
                ok = {"text/plain": {"schema": {"type": "string"}}}
            else:
                schema = {"type": "object"} if answer == "object" else refs[(answer, "validation")]
                ok = {"application/json": {"schema": schema}}
            if streams:
                ok["text/event-stream"] = {"schema": {"type": "string"}}
            op["responses"] = {
                "200": {"description": "Success", **({"content": ok} if ok else {})},
                **{code: {"description": why, "content": error} for code, why in ERROR_STATUSES.items()},
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
