"""An ASGI middleware that refuses request bodies past `--max-request-bytes` with a 413, before they are read whole.

A declared Content-Length over the limit is refused at once; a chunked body is counted as it arrives and refused
when it passes the limit. Either way the route never sees it.
"""

from __future__ import annotations

from gramserve.server.error_handlers import error_response


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
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
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"the request body is larger than the {self.max_bytes}-byte limit (--max-request-bytes)"
        await error_response(413, message)(scope, receive, send)
