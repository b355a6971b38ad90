"""An ASGI middleware that refuses request bodies past `--max-request-bytes` with a 413, before they are read whole.

A declared Content-Length over the limit is refused at once; a chunked body is counted as it arrives and refused
when it passes the limit. Either way the route never sees it.
"""

from __future__ import annotations

import json

_TOO_LARGE = 413


class BodyTooLarge(Exception):
    pass


def _error_body(limit: int) -> bytes:
    message = f"the request body is larger than the {limit}-byte limit (--max-request-bytes)"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return json.dumps({"error": error}).encode()


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        # `send` is not wrapped (it runs for every streamed chunk): the routes read the whole body before they
        # answer, so a body found too large has no response started yet.
        try:
            await self.app(scope, counted_receive, send)
        except BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = _error_body(self.max_bytes)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": _TOO_LARGE, "headers": headers})
        await send({"type": "http.response.body", "body": body})
