"""An ASGI middleware that refuses request bodies past their limit with a 413, before they are read whole.

Every body is bounded by `--max-request-bytes`, except on the paths given their own limit (POST /v1/files: the
upload limit, --max-file-bytes). A declared Content-Length over the limit is refused at once; a chunked body is
counted as it arrives and refused when it passes the limit. Either way the route never sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gramserve.server.error_handlers import error_response


@dataclass(frozen=True)
class BodyLimit:
    max_bytes: int
    message: str  # the 413's message


def default_limit(max_bytes: int) -> BodyLimit:
    return BodyLimit(max_bytes, f"the request body is larger than the {max_bytes}-byte limit (--max-request-bytes)")


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, path_limits: Mapping[str, BodyLimit] | None = None):
        self.app = app
        self.default = default_limit(max_bytes)
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.path_limits.get(scope["path"], self.default)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit.max_bytes:
            return await self._refuse(limit, scope, receive, send)
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit.max_bytes:
                    raise BodyTooLarge
            return message

        # `send` is not wrapped (it runs for every streamed chunk): the routes read the whole body before they
        # answer, so a body found too large has no response started yet.
        try:
            await self.app(scope, counted_receive, send)
        except BodyTooLarge:
            await self._refuse(limit, scope, receive, send)

    async def _refuse(self, limit: BodyLimit, scope, receive, send) -> None:
        await error_response(413, limit.message)(scope, receive, send)
