"""Running one batch line through the OpenAI layer, exactly as its HTTP route would run it.

The body is read into the route's pydantic model (`request_body.validate_body`), and `OpenAIServing.chat` /
`.completions` called (they check the model name: the base model or a LoRA adapter); an error becomes the status
and OpenAI error body the route would answer (`error_handlers.response_for`). What differs: `"stream": true` is
refused (a batch writes whole responses), and the line runs at the body's priority plus BATCH_PRIORITY_OFFSET, so the
scheduler's waiting queue puts it after every interactive request.

Errors that say the server cannot serve now (shutting down, a stalled scheduler, a full queue) are not the line's
outcome: they raise RetryLater, and the line runs again later (after a restart, if the server is stopping).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from pydantic import BaseModel

from gramserve.config import ServerArgs
from gramserve.server import protocol as P
from gramserve.server.error_handlers import response_for
from gramserve.server.errors import EngineUnavailableError, InvalidRequestError, ServerBusyError
from gramserve.server.openai_serving import OpenAIServing
from gramserve.server.request_body import set_body_bytes, validate_body

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
# Interactive priorities are 32-bit (protocol.INT32_MAX): past that range, every batch line sorts after them.
BATCH_PRIORITY_OFFSET = 1 << 32


class RetryLater(Exception):
    """The server could not run the line now; it is not the line's result."""


@dataclass(frozen=True)
class LineOutcome:
    status_code: int
    body: dict[str, Any]


def engine_requests(endpoint: str, body: dict[str, Any]) -> int:
    """How many engine requests a line's body asks for (`n`, times the prompts of a completions request), from the
    raw body: a line counts this much against --batch-max-in-flight."""
    n = body.get("n")
    n = n if isinstance(n, int) and n > 1 else 1
    prompt = body.get("prompt") if endpoint == COMPLETIONS_ENDPOINT else None
    if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt):
        return n * len(prompt)
    return n


class LineExecutor:
    def __init__(self, serving: OpenAIServing, args: ServerArgs):
        self.args = args
        self._routes: dict[str, tuple[type[BaseModel], Callable[..., Awaitable[BaseModel]]]] = {
            CHAT_ENDPOINT: (P.ChatCompletionRequest, serving.chat),
            COMPLETIONS_ENDPOINT: (P.CompletionRequest, serving.completions),
        }

    async def run(self, endpoint: str, body: dict[str, Any], size: int) -> LineOutcome:
        """The line's status and response body; raises RetryLater when the server cannot run it now. Call it in a
        task of its own: it sets the task's body size (large bodies are prepared off the event loop)."""
        set_body_bytes(size)
        try:
            return LineOutcome(200, await self._respond(endpoint, body))
        except (EngineUnavailableError, ServerBusyError) as exc:
            raise RetryLater(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - the route's own error answer becomes the line's result
            answer = response_for(exc)
            return LineOutcome(answer.status_code, json.loads(answer.body))

    async def _respond(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        model_cls, serve = self._routes[endpoint]
        req = validate_body(body, model_cls)
        if req.stream:
            raise InvalidRequestError(
                "stream is not supported in a batch: each response is written whole to the output file", "stream"
            )
        req = req.model_copy(update={"priority": req.priority + BATCH_PRIORITY_OFFSET})
        response = await serve(req, None)
        return response.model_dump()
