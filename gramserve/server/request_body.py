"""Read a request's JSON body into its pydantic model; a body that is not a JSON object is a 400, as is one nested
too deep for the parser or holding a lone UTF-16 surrogate (no tokenizer can encode it)."""

from __future__ import annotations

import contextvars
import json
import re
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gramserve.server.errors import InvalidRequestError

ModelT = TypeVar("ModelT", bound=BaseModel)


_BODY_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("body_bytes", default=0)


def body_bytes() -> int:
    """The size of the body of the request being served (0 before it is read)."""
    return _BODY_BYTES.get()


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \uD800-\uDFFF: an emoji's pair, or a lone half


def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequestError("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return body


def set_body_bytes(size: int) -> None:
    """Record the size of the body being served (for work outside an HTTP request: a batch line, in its task)."""
    _BODY_BYTES.set(size)


async def read_json_object(request: Request) -> dict:
    raw = await request.body()
    set_body_bytes(len(raw))
    return parse_json_object(raw)


def validate_body(body: dict, model_cls: type[ModelT]) -> ModelT:
    """A JSON object as `model_cls`; pydantic's errors become a RequestValidationError (a 400, error_handlers.py)."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


async def parse_body(request: Request, model_cls: type[ModelT]) -> ModelT:
    return validate_body(await read_json_object(request), model_cls)
