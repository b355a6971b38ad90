"""Server-sent events: the `data:` framing, the error event that ends a stream which fails after its first byte,
sse_stream (a stream of response objects as events), prefetch_first, which keeps errors before the first token
plain HTTP errors, and interleave, which merges streams as their items come."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from gramserve.server.error_handlers import response_for
from gramserve.server.errors import ClientDisconnectedError

SSE_DONE = "data: [DONE]\n\n"


# JSON lets these stay unescaped, but clients that split the stream with str.splitlines (httpx's aiter_lines, which
# the benchmarks and many scripts use) end the line there and get half an event.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: Any) -> str:
    body = data.model_dump_json(exclude_none=False) if hasattr(data, "model_dump_json") else json.dumps(data)
    if not body.isascii():
        body = body.translate(_LINE_BREAKS)  # only inside JSON strings: the characters never occur elsewhere
    return f"data: {body}\n\n"


def error_event(exc: Exception) -> str:
    """The last event of a stream that fails midway: the error body the same failure gets as an HTTP answer."""
    return f"data: {response_for(exc).body.decode().translate(_LINE_BREAKS)}\n\n"


STREAM_ERRORS_PASSED_ON = (ClientDisconnectedError,)  # nobody to tell: the stream ends without an event


class Prefetched:
    """A stream whose first item was taken already; closing it closes the stream even before it is iterated (an
    async generator that never started skips its `finally`, which would leave the engine request running)."""

    def __init__(self, first: Any, gen: AsyncIterator):
        self._first, self._gen = first, gen

    def __aiter__(self) -> "Prefetched":
        return self

    async def __anext__(self) -> Any:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        self._first = None
        await self._gen.aclose()


async def prefetch_first(gen: AsyncIterator) -> Prefetched:
    """Wait for the first item before the HTTP response starts, so that errors found by the engine
    (e.g. a grammar that does not compile) still become a 400 instead of an error inside a 200 stream."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        first = None
    return Prefetched(first, gen)


async def sse_stream(items: AsyncIterator[Any]) -> AsyncIterator[str]:
    """Each item (a response model or a dict) as one event, then [DONE]; a failure midway becomes the last event."""
    try:
        async for item in items:
            yield sse(item)
    except STREAM_ERRORS_PASSED_ON:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error is its last event
        yield error_event(exc)
    finally:
        await items.aclose()
    yield SSE_DONE


async def interleave(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(index of its stream, item) for the items of all `streams`, each as soon as it comes. A stream that raises
    ends the merge with its error; closing the merge closes every stream."""
    if len(streams) == 1:  # the usual case: no task and queue hop per item
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(k: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((k, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((k, exc))
            return
        await queue.put((k, done))

    tasks = [asyncio.create_task(drain(k, stream)) for k, stream in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            k, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
