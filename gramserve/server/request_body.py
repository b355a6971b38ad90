"""Read a request's JSON body into its pydantic model; a body that is not a JSON object is a 400."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gramserve.server.errors import InvalidRequestError

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


async def parse_body(request: Request, model_cls: type[ModelT]) -> ModelT:
    body = await read_json_object(request)
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
