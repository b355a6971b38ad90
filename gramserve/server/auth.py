"""API keys: an ASGI middleware that asks for `Authorization: Bearer KEY` on every route but the open ones.

`--api-key` (or GRAMSERVE_API_KEY) guards every route except /health (and /metrics unless
`--metrics-require-key`). `--admin-api-key` (or GRAMSERVE_ADMIN_API_KEY), when set, is the only key the admin
routes take (/flush_cache, /abort_request, /load_lora_adapter, /unload_lora_adapter); without it they take the API
key. Keys are compared in constant time.
A wrong or missing key gets a 401 with OpenAI's error JSON.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from gramserve.server.error_handlers import error_response

ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/load_lora_adapter", "/unload_lora_adapter"})


@dataclass(frozen=True)
class KeyPolicy:
    api_key: str | None
    admin_api_key: str | None
    open_paths: frozenset[str]

    def required_key(self, path: str) -> str | None:
        """The key a request to `path` must carry; None: no key needed."""
        if path in ADMIN_PATHS and self.admin_api_key:
            return self.admin_api_key
        if path in self.open_paths:
            return None
        return self.api_key


def key_policy(api_key: str | None, admin_api_key: str | None, metrics_require_key: bool) -> KeyPolicy:
    open_paths = {"/health"} if metrics_require_key else {"/health", "/metrics"}
    return KeyPolicy(api_key or None, admin_api_key or None, frozenset(open_paths))


def _bearer(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


UNAUTHORIZED = "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'."


class ApiKeyMiddleware:
    def __init__(self, app, policy: KeyPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            key = self.policy.required_key(scope["path"])
            if key is not None and not hmac.compare_digest(_bearer(scope.get("headers") or []), key.encode()):
                refusal = error_response(401, UNAUTHORIZED, code="invalid_api_key")
                refusal.headers["WWW-Authenticate"] = "Bearer"
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)
