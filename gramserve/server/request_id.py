"""Request ids and the access log: an ASGI middleware.

Each HTTP request gets an id: the client's `X-Request-Id` when it sent a sane one, else a fresh one. The id goes
back in the `X-Request-Id` header and into the response's `id` (`chatcmpl-<id>`, `cmpl-<id>`), which starts the
ids of its engine requests, so every log line about the request names it. (A client may send the same id twice
at once: its engine requests then get a short suffix, `engine_rid_base`, so they never collide.) When the
response ends, one access-log line gives the id, method, path, status and latency (uvicorn's own is off).
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid

access_log = logging.getLogger("gramserve.access")

# (id, whether the client chose it)
_CURRENT: contextvars.ContextVar[tuple[str, bool] | None] = contextvars.ContextVar("request_id", default=None)
_SANE = re.compile(r"[A-Za-z0-9._:\-]{1,96}")
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled constantly: logged at DEBUG


def current_request_id() -> str:
    """The id of the HTTP request being served (a fresh one outside a request)."""
    current = _CURRENT.get()
    return current[0] if current else uuid.uuid4().hex


def set_request_id(request_id: str) -> None:
    """Make `request_id` the id of the work in this task's context, outside an HTTP request (a batch line): its
    response id and engine request ids then carry it."""
    _CURRENT.set((request_id, False))


def response_id(prefix: str) -> str:
    return f"{prefix}-{current_request_id()}"


def engine_rid_base(rid: str) -> str:
    """What the engine request ids of a response with id `rid` start with."""
    current = _CURRENT.get()
    return f"{rid}.{uuid.uuid4().hex[:8]}" if current and current[1] else rid


class RequestIdMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        from_client = bool(_SANE.fullmatch(sent))
        request_id = sent if from_client else uuid.uuid4().hex
        token = _CURRENT.set((request_id, from_client))
        start = time.monotonic()
        status = 0

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _CURRENT.reset(token)
            level = logging.DEBUG if scope["path"] in QUIET_PATHS and status == 200 else logging.INFO
            access_log.log(
                level,
                "%s %s %s %d %.1f ms",
                request_id,
                scope["method"],
                scope["path"],
                status,
                (time.monotonic() - start) * 1e3,
            )
