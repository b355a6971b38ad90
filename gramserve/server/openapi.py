"""The OpenAPI document (/openapi.json) with the real request and response bodies.

The generation and Batch API routes read their bodies themselves (request_body.py: size, nesting and surrogate
checks before pydantic; batch/upload.py: a multipart upload streamed to disk), so FastAPI sees no body parameter;
this fills in each route's typed request body, its JSON (or, when streamed, event-stream; or raw bytes) answer, and
the OpenAI error body of its 4xx / 5xx answers.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gramserve.server import protocol as P
from gramserve.server.batch import models as B

# POST /v1/files reads its multipart body itself (batch/upload.py), streaming the file to disk.
UPLOAD_BODY = {
    "multipart/form-data": {
        "schema": {
            "type": "object",
            "required": ["file", "purpose"],
            "properties": {
                "file": {"type": "string", "format": "binary"},
                "purpose": {"type": "string", "enum": ["batch"]},
            },
        }
    }
}

# (path, method): (request body: a model (JSON), a content dict, or None; 200 answer: a model, "object" (any JSON
# object), "objects" (an object, or a list of them: a batch), "text", "binary" or "empty"; whether it may stream)
ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | dict | None, type[BaseModel] | str, bool]] = {
    ("/v1/chat/completions", "post"): (P.ChatCompletionRequest, P.ChatCompletionResponse, True),
    ("/v1/completions", "post"): (P.CompletionRequest, P.CompletionResponse, True),
    ("/generate", "post"): (P.GenerateRequest, "objects", True),
    ("/abort_request", "post"): (P.AbortRequest, "object", False),
    ("/v1/models", "get"): (None, P.ModelList, False),
    ("/v1/models/{model_id}", "get"): (None, P.ModelCard, False),
    ("/health", "get"): (None, "empty", False),
    ("/get_server_info", "get"): (None, "object", False),
    ("/metrics", "get"): (None, "text", False),
    ("/flush_cache", "post"): (None, "object", False),
    ("/load_lora_adapter", "post"): (P.LoadLoRARequest, P.LoRAAdapterResponse, False),
    ("/unload_lora_adapter", "post"): (P.UnloadLoRARequest, P.LoRAAdapterResponse, False),
    ("/v1/files", "post"): (UPLOAD_BODY, B.FileObject, False),
    ("/v1/files", "get"): (None, B.FileList, False),
    ("/v1/files/{file_id}", "get"): (None, B.FileObject, False),
    ("/v1/files/{file_id}", "delete"): (None, B.FileDeleted, False),
    ("/v1/files/{file_id}/content", "get"): (None, "binary", False),
    ("/v1/batches", "post"): (B.BatchCreateRequest, B.Batch, False),
    ("/v1/batches", "get"): (None, B.BatchList, False),
    ("/v1/batches/{batch_id}", "get"): (None, B.Batch, False),
    ("/v1/batches/{batch_id}/cancel", "post"): (None, B.Batch, False),
}
ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model, LoRA adapter, file or batch",
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
            if isinstance(body, dict):
                op["requestBody"] = {"required": True, "content": body}
            elif body is not None:
                schema = refs[(body, "validation")]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
            if answer == "empty":
                ok: dict = {}
            elif answer == "text":
                ok = {"text/plain": {"schema": {"type": "string"}}}
            elif answer == "binary":
                ok = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
            else:
                if answer == "object":
                    schema = {"type": "object"}
                elif answer == "objects":
                    schema = {"oneOf": [{"type": "object"}, {"type": "array", "items": {"type": "object"}}]}
                else:
                    schema = refs[(answer, "validation")]
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
