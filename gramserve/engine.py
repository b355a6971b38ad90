"""The offline Engine: gramserve in a Python program, without the HTTP server.

`Engine(model=..., **server_args)` starts the same scheduler, detokenizer and grammar processes as `gramserve serve`
(server/processes.py) and runs the TokenizerManager and the OpenAI layer on an event loop of its own, in a
background thread. Its methods take the HTTP API's parameters and go down the same code below the routes:

* `generate` / `async_generate`: SGLang's /generate (text or token ids plus a `sampling_params` dict, where
  `json_schema`, `regex`, `ebnf`, ... constrain the output); a list of prompts runs as one batch;
* `chat` / `async_chat`: OpenAI's /v1/chat/completions (messages, `response_format` — also a pydantic model class —,
  tools, `n`, ...); a list of conversations runs as one batch;
* `completions` / `async_completions`: OpenAI's /v1/completions.

Answers are the HTTP API's JSON bodies as dicts. `stream=True` returns an iterator (an async one from the `async_`
methods) of the stream's chunks. A bad request raises the error the HTTP route answers with: a ValueError
(`InvalidRequestError`, `SamplingParamsError`) where HTTP answers 400. Use it as a context manager, or call
`shutdown()`. A script that starts an Engine needs `if __name__ == "__main__":` (the child processes are spawned).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from pydantic import BaseModel, ValidationError

from gramserve.config import ServerArgs
from gramserve.server import protocol as P
from gramserve.server.error_handlers import validation_message
from gramserve.server.errors import InvalidRequestError
from gramserve.server.native_batch import split_generate
from gramserve.server.native_serving import NativeServing, gather_all
from gramserve.server.openai_serving import OpenAIServing
from gramserve.server.processes import EngineProcesses, start_engine_processes
from gramserve.server.tokenizer_manager import TokenizerManager
from gramserve.server.warmup import warm_up_server

logger = logging.getLogger("gramserve")

_END = object()  # a stream's end, in the queues that carry its items across threads


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _validated(model_cls: type[BaseModel], body: dict) -> Any:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequestError(*validation_message(exc.errors())) from None


def _response_format(value: Any) -> Any:
    """A pydantic model class as `response_format` becomes its strict JSON schema, as the openai SDK's parse does."""
    if isinstance(value, type) and issubclass(value, BaseModel):
        schema = value.model_json_schema()
        return {"type": "json_schema", "json_schema": {"name": value.__name__, "schema": schema, "strict": True}}
    return value


def _as_dict(item: Any) -> Any:
    return item.model_dump() if isinstance(item, BaseModel) else item


class Engine:
    """gramserve in-process. Keyword arguments are `gramserve serve`'s options with underscores (`ServerArgs`):
    `Engine(model="model.gguf", grammar_backend="xgrammar", max_running_requests=64)`."""

    def __init__(self, model: str | None = None, **server_args: Any):
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(server_args) - names)
        if unknown:
            raise TypeError(f"unknown Engine arguments {unknown}; they are `gramserve serve`'s options (ServerArgs)")
        server_args.setdefault("log_level", "warning")  # a library: the child processes log warnings and errors
        self.args = ServerArgs(model_path=model, **server_args)
        self._closed = True  # until everything below has started
        self._procs: EngineProcesses = start_engine_processes(self.args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gramserve-engine", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._run(self._start())
        except BaseException:
            self.shutdown()
            raise
        # The watchdog and the atexit hook hold the Engine weakly, so a dropped Engine is freed (and __del__ stops its
        # children); one still alive at exit is shut down then.
        ref = weakref.ref(self)
        tm, health = self.tm, self._procs.health
        self._procs.watch(
            lambda _name: tm.fail_all_threadsafe(health.problem()), lambda: (e := ref()) is None or e._closed
        )
        self._atexit = lambda: (engine := ref()) is not None and engine.shutdown()
        atexit.register(self._atexit)

    async def _start(self) -> None:
        procs = self._procs
        info = procs.runner_info
        self.tm = TokenizerManager(
            procs.config, procs.tokenizer, info["context_length"], info["vocab_size"], procs.health
        )
        self.tm.start()
        self._openai = OpenAIServing(self.tm, procs.config)
        self._native = NativeServing(self.args, self.tm)
        if procs.health.warming:
            await warm_up_server(procs.config, self.tm, info)

    # --- what the engine serves -------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self._procs.tokenizer

    @property
    def model_name(self) -> str:
        return self.args.model_name

    @property
    def context_length(self) -> int:
        return self._procs.runner_info["context_length"]

    @property
    def max_running_requests(self) -> int:
        return self._procs.config.settings.max_running_requests

    # --- generate (SGLang's /generate) --------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **options: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt (text or `input_ids`) -> its answer {"text", "output_ids", "meta_info"}; a list of prompts ->
        the list of answers, run as one batch. `sampling_params`: one dict, or one per prompt. `options`: the
        /generate fields `return_logprob`, `top_logprobs_num`, `rid`, `priority`; `n` in `sampling_params` gives n
        answers a prompt. `stream=True`: an iterator of answers, each holding the whole output so far (a batch's
        carry their `index`)."""
        reqs, many = self._generate_requests(prompt, sampling_params, input_ids, stream, options)
        if stream:
            return self._iterate(self._generate_stream(reqs, many))
        if many:
            return self._run(self._native.generate_many(reqs))
        return self._run(self._native.generate(reqs[0]))

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        **options: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate`, awaited from the caller's event loop."""
        reqs, many = self._generate_requests(prompt, sampling_params, input_ids, stream, options)
        if stream:
            return await self._aiterate(self._generate_stream(reqs, many))
        if many:
            return await self._await(self._native.generate_many(reqs))
        return await self._await(self._native.generate(reqs[0]))

    async def _generate_stream(self, reqs: list, many: bool) -> AsyncIterator[dict]:
        if many:
            return await self._native.generate_many_stream(reqs)
        return await self._native.generate_stream(reqs[0])

    def _generate_requests(self, prompt, sampling_params, input_ids, stream: bool, options: dict) -> tuple[list, bool]:
        """/generate's body for these arguments, split as the route splits it (native_batch.py)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt and input_ids", "prompt")
        body = {"text": prompt} if prompt is not None else {"input_ids": input_ids}
        body |= {"sampling_params": sampling_params or {}, "stream": stream, **options}
        return split_generate(_validated(P.GenerateRequest, body), self.args.max_n, self.args.max_queued_requests)

    # --- chat and completions (OpenAI's) -----------------------------------------------------------------

    def chat(self, messages: list[dict] | list[list[dict]], *, stream: bool = False, **params: Any):
        """A chat completion, as /v1/chat/completions answers it (a dict); `params` are its request fields
        (`response_format`, `tools`, `max_tokens`, `temperature`, ...). A list of conversations -> a list of
        answers, run as one batch. `stream=True` (one conversation): an iterator of chunk dicts."""
        reqs = self._chat_requests(messages, stream, params)
        if stream:
            return self._iterate(self._openai.chat_chunks(reqs[0], None))
        if self._many_conversations(messages):
            return self._run(self._all(self._chat_one, reqs))
        return self._run(self._chat_one(reqs[0]))

    async def async_chat(self, messages: list[dict] | list[list[dict]], *, stream: bool = False, **params: Any):
        """`chat`, awaited from the caller's event loop."""
        reqs = self._chat_requests(messages, stream, params)
        if stream:
            return await self._aiterate(self._openai.chat_chunks(reqs[0], None))
        if self._many_conversations(messages):
            return await self._await(self._all(self._chat_one, reqs))
        return await self._await(self._chat_one(reqs[0]))

    def completions(self, prompt: Any, *, stream: bool = False, **params: Any):
        """A text completion, as /v1/completions answers it (a dict; `prompt` as the API takes it)."""
        req = self._completion_request(prompt, stream, params)
        if stream:
            return self._iterate(self._openai.completion_chunks(req, None))
        return self._run(self._completion_one(req))

    async def async_completions(self, prompt: Any, *, stream: bool = False, **params: Any):
        """`completions`, awaited from the caller's event loop."""
        req = self._completion_request(prompt, stream, params)
        if stream:
            return await self._aiterate(self._openai.completion_chunks(req, None))
        return await self._await(self._completion_one(req))

    @staticmethod
    def _many_conversations(messages: Any) -> bool:
        return bool(messages) and isinstance(messages[0], list)

    def _chat_requests(self, messages, stream: bool, params: dict) -> list[P.ChatCompletionRequest]:
        conversations = messages if self._many_conversations(messages) else [messages]
        if stream and len(conversations) > 1:
            raise InvalidRequestError("stream=True takes a single conversation", "stream")
        params = dict(params)
        if "response_format" in params:
            params["response_format"] = _response_format(params["response_format"])
        params.setdefault("model", self.model_name)
        return [_validated(P.ChatCompletionRequest, {**params, "messages": m, "stream": stream}) for m in conversations]

    def _completion_request(self, prompt, stream: bool, params: dict) -> P.CompletionRequest:
        params = {"model": self.model_name, **params, "prompt": prompt, "stream": stream}
        if "response_format" in params:
            params["response_format"] = _response_format(params["response_format"])
        return _validated(P.CompletionRequest, params)

    async def _chat_one(self, req: P.ChatCompletionRequest) -> dict:
        return (await self._openai.chat(req, None)).model_dump()

    async def _completion_one(self, req: P.CompletionRequest) -> dict:
        return (await self._openai.completions(req, None)).model_dump()

    # --- running on the engine's event loop ---------------------------------------------------------------

    @staticmethod
    async def _all(one: Callable[[Any], Awaitable[Any]], reqs: list) -> list:
        """Every request at once; the first failure raises and the others are aborted."""
        return await gather_all(one, reqs)

    def _check_open(self, coro: Awaitable[Any]) -> None:
        if self._closed:
            coro.close()  # never to run
            raise RuntimeError("the Engine is shut down")

    def _run(self, coro: Awaitable[Any]) -> Any:
        """Run `coro` on the engine's loop and wait for it here (an interrupt aborts it)."""
        self._check_open(coro)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    async def _await(self, coro: Awaitable[Any]) -> Any:
        """Run `coro` on the engine's loop, awaited from the caller's (cancelling the caller cancels it)."""
        self._check_open(coro)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _pump(self, start: Awaitable[AsyncIterator], put: Callable[[Any], None]) -> Any:
        """Run a stream on the engine's loop, handing each item (as a dict) to `put`; `put` gets `_END` first once the
        stream has started (its request checked), then the items, then `_END` again, or a `_Failed`."""

        async def pump() -> None:
            try:
                items = await start
                put(_END)
                try:
                    async for item in items:
                        put(_as_dict(item))
                finally:
                    await items.aclose()
            except asyncio.CancelledError:  # by the consumer (nobody reads this) or by shutdown()
                with contextlib.suppress(RuntimeError):  # the consumer's loop may be gone
                    put(_Failed(RuntimeError("the stream was cancelled: the Engine is shutting down")))
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                put(_Failed(exc))
                return
            put(_END)

        coro = pump()
        if self._closed:
            start.close()
        self._check_open(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _iterate(self, start: Awaitable[AsyncIterator]) -> Iterator[dict]:
        items: queue.Queue = queue.Queue()
        future = self._pump(start, items.put)
        try:
            first = items.get()  # errors in the request raise here, before an iterator is handed out
        except BaseException:
            future.cancel()
            raise
        if isinstance(first, _Failed):
            raise first.exc

        def iterate() -> Iterator[dict]:
            try:
                while (item := items.get()) is not _END:
                    if isinstance(item, _Failed):
                        raise item.exc
                    yield item
            finally:
                future.cancel()  # a consumer that stops early aborts the request

        stream = iterate()
        weakref.finalize(stream, future.cancel)  # and so does one that drops it unread
        return stream

    async def _aiterate(self, start: Awaitable[AsyncIterator]) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        future = self._pump(start, lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        try:
            first = await items.get()
        except BaseException:
            future.cancel()
            raise
        if isinstance(first, _Failed):
            raise first.exc

        async def iterate() -> AsyncIterator[dict]:
            try:
                while (item := await items.get()) is not _END:
                    if isinstance(item, _Failed):
                        raise item.exc
                    yield item
            finally:
                future.cancel()

        stream = iterate()
        weakref.finalize(stream, future.cancel)
        return stream

    # --- lifetime ------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Fail what still runs, stop the event loop and the child processes. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(getattr(self, "_atexit", None) or (lambda: None))
        if self._thread.is_alive():
            tm = getattr(self, "tm", None)

            async def close() -> None:
                if tm is not None:
                    tm.fail_all("the engine is shutting down")
                    await asyncio.sleep(0)  # let the failed requests see it
                # What is left (a prompt still being tokenized, a call that came in just now) is cancelled: its
                # caller gets CancelledError rather than waiting forever.
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.wait(others, timeout=5) if others else None
                if tm is not None:
                    tm.close()

            try:
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.exception("engine shutdown: closing the TokenizerManager failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()
        self._procs.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()
