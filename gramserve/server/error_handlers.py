"""Every error a route can raise, mapped to its HTTP status and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gramserve.sampling.params import SamplingParamsError
from gramserve.server import protocol as P
from gramserve.server.errors import (
    ClientDisconnectedError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotServedError,
    RequestTimeoutError,
    ServerBusyError,
)

logger = logging.getLogger(__name__)


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorDetail(message=message, type=err_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A request body's validation errors (pydantic's `errors()`) as one message, and the first field named."""
    parts, param = [], None
    for err in errors:
        loc = list(err.get("loc", ()))
        if loc[:1] in (["body"], ["query"], ["path"]):  # FastAPI's location of the field, not part of its name
            loc = loc[1:]
        loc = [str(x) for x in loc]
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def _on_validation(exc: RequestValidationError) -> JSONResponse:
    msg, param = validation_message(exc.errors())
    return error_response(400, msg, param=param)


def _on_http(exc: StarletteHTTPException) -> JSONResponse:
    err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    resp = error_response(exc.status_code, str(exc.detail), err_type=err_type)
    resp.headers.update(exc.headers or {})  # a 405's Allow
    return resp


def _on_busy(exc: ServerBusyError) -> JSONResponse:
    resp = error_response(503, str(exc), err_type="server_busy")
    resp.headers["Retry-After"] = "1"
    return resp


def _on_internal(exc: Exception) -> JSONResponse:
    logger.exception("internal error")
    return error_response(500, f"internal server error: {type(exc).__name__}", err_type="internal_error")


ERROR_HANDLERS: dict[type[Exception], Callable[..., JSONResponse]] = {
    RequestValidationError: _on_validation,
    InvalidRequestError: lambda exc: error_response(exc.status, str(exc), param=exc.param),
    SamplingParamsError: lambda exc: error_response(400, str(exc), param=exc.param),
    ModelNotServedError: lambda exc: error_response(404, str(exc), param="model", code="model_not_found"),
    StarletteHTTPException: _on_http,
    ClientDisconnectedError: lambda exc: error_response(
        499, "client closed the request", err_type="client_closed_request"
    ),
    ServerBusyError: _on_busy,
    EngineError: lambda exc: error_response(500, str(exc), err_type="internal_error"),
    EngineUnavailableError: lambda exc: error_response(503, str(exc), err_type="service_unavailable"),
    RequestTimeoutError: lambda exc: error_response(504, str(exc), err_type="timeout"),
    Exception: _on_internal,
}


def response_for(exc: Exception) -> JSONResponse:
    """The error response of `exc`, by the handler of its closest class (streams reuse it as their last event)."""
    for cls in type(exc).__mro__:
        if cls in ERROR_HANDLERS:
            return ERROR_HANDLERS[cls](exc)
    return _on_internal(exc)


def _as_handler(to_response: Callable[..., JSONResponse]) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return to_response(exc)

    return handler


def register_error_handlers(app: FastAPI) -> None:
    for exc_type, to_response in ERROR_HANDLERS.items():
        app.add_exception_handler(exc_type, _as_handler(to_response))
