"""The errors a request can end in; error_handlers.py turns each into its HTTP status and OpenAI error body."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the client must fix; becomes a 400 (or `status`: 403 for what the operator did not allow)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


class ModelNotServedError(Exception):
    """The request names a model this server does not serve; becomes a 404."""


class ServerBusyError(Exception):
    """The waiting queue is full; becomes a 503 with Retry-After."""


class EngineUnavailableError(Exception):
    """The server cannot serve now (a stalled or dead scheduler, a shutdown); becomes a 503."""


class RequestTimeoutError(Exception):
    """The request ran past --request-timeout; becomes a 504."""


class EngineError(Exception):
    """The engine failed the request before producing anything; becomes a 500."""


class ClientDisconnectedError(Exception):
    """The HTTP client went away; the request was aborted."""
