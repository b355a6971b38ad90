"""TokenizerManager: the main process's bridge to the scheduler.

It tokenizes (large requests on a small thread pool, `off_loop`, so a long prompt never stalls the event loop; a
text too long for the context is refused before it is tokenized), sends TokenizedGenerateReq to the scheduler
and turns the detokenizer's BatchTextOut messages back into a per-request async stream. A request whose consumer
goes away (client disconnect, cancelled task) is aborted so its KV slots come back at once. It trusts the requests
it is given: the routes check them first (sampling_request.py, request_checks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import zmq
import zmq.asyncio

from gramserve.config import ServerConfig
from gramserve.grammar.backends import vocab_bytes
from gramserve.grammar.schema_relax import RELAXED
from gramserve.ipc import SCHEDULER_IN, TOKENIZER_MANAGER_IN, pull_socket, push_socket
from gramserve.messages import (
    AbortReq,
    BatchTextOut,
    ControlReq,
    ControlResp,
    FinishReason,
    GrammarPrefetchReq,
    GrammarRequest,
    ImageInput,
    TokenizedGenerateReq,
    TokenLogprob,
)
from gramserve.model.loader import load_config_dict, resolve_model
from gramserve.model.model_config import ModelConfig
from gramserve.multimodal.images import ImageLimits
from gramserve.multimodal.processors import ImageProcessor, image_processor
from gramserve.sampling.params import SamplingParams
from gramserve.server.chat_output import ChoiceStream
from gramserve.server.errors import (
    ClientDisconnectedError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestTimeoutError,
    ServerBusyError,
)
from gramserve.server.health import ServerHealth
from gramserve.server.lora_registry import LoRANotFoundError, LoRARegistry
from gramserve.server.metrics import RequestMetrics, RequestWatch
from gramserve.server.output_check import CheckTarget, OutputChecker
from gramserve.server.tool_requests import ToolPlan
from gramserve.server.warmup import WARMUP_RID_PREFIX

logger = logging.getLogger(__name__)

DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request checks that its client is still there
# A retry after a failed last check samples at least this hot: a greedy retry would repeat the failed output.
RETRY_MIN_TEMPERATURE = 0.7
PREP_THREADS = 4  # request preparation (templates, tokenizing, grammar texts) off the event loop
PREFETCH_MEMORY = 1024  # grammars remembered as prefetched (prefetch_grammar)
HEALTH_CHECK_S = 1.0  # how often in-flight requests are failed when the server cannot serve (health.py)


def _error_of(fin: FinishReason, param: str | None) -> Exception:
    """The exception an engine request that ended with an error status raises (`param`: the field of a 400)."""
    if fin.status_code == 400:
        return InvalidRequestError(fin.message or "invalid request", param)
    if fin.status_code == 503:
        return ServerBusyError(fin.message or "server busy")
    if fin.status_code == 404:
        return LoRANotFoundError(fin.message or "LoRA adapter not found")
    return EngineError(fin.message or "internal error")


@dataclass
class GenerateOutput:
    """One piece of a request's stream."""

    text: str
    token_ids: list[int]
    finished: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None
    grammar_backend: str | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.finished.type if self.finished is not None else None

    @property
    def matched_stop(self) -> int | str | None:
        return self.finished.matched if self.finished is not None else None

    @property
    def answer_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the answer's tokens: without the EOS / stop token that ended it (its text is not part of
        the answer either; OpenAI lists neither). /generate keeps it, beside `output_ids`."""
        lps = self.logprobs or []
        stop = self.matched_stop
        return lps[:-1] if lps and isinstance(stop, int) and lps[-1].token_id == stop else lps


def _image_processor(config: ServerConfig, tokenizer, vocab_size: int) -> tuple[ImageProcessor | None, ImageLimits]:
    """The model's image processor (None for a text model) and the operator's image limits."""
    args = config.args
    limits = ImageLimits(
        args.max_image_bytes,
        args.max_image_pixels,
        args.allowed_local_media_path,
        args.allowed_media_domains,
        args.media_fetch_timeout,
    )
    path = resolve_model(args.model_path, args.load_format)[0]
    model_cfg = ModelConfig.from_dict(load_config_dict(path))
    return image_processor(model_cfg, path if os.path.isdir(path) else None, tokenizer, vocab_size), limits


class _ReqState:
    """A request's outputs that its generator has not taken yet, and the future that generator sleeps on.

    A generator takes everything that arrived since it last ran, and `_attempt` merges it into one output: when the
    event loop falls behind the scheduler under load, a stream sends fewer, larger chunks instead of falling further
    behind (one chunk costs the loop about as much as one token did)."""

    __slots__ = ("pending", "waiter", "finished")

    def __init__(self) -> None:
        self.pending: list[GenerateOutput | Exception] = []
        self.waiter: asyncio.Future | None = None
        self.finished = False

    def put(self, item: GenerateOutput | Exception) -> None:
        self.pending.append(item)
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[GenerateOutput | Exception]:
        """What arrived since the last take; [] when only woken (the periodic tick of `_tick_loop`)."""
        if not self.pending:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.pending = self.pending, []
        return items


def merge_outputs(outs: list[GenerateOutput]) -> GenerateOutput:
    """Consecutive outputs of one request as one (the last one's counts and finish; texts, ids, logprobs joined)."""
    if len(outs) == 1:
        return outs[0]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in o.logprobs or ()]
    return replace(
        outs[-1],
        text="".join(o.text for o in outs),
        token_ids=[t for o in outs for t in o.token_ids],
        logprobs=logprobs,
        grammar_backend=next((o.grammar_backend for o in reversed(outs) if o.grammar_backend), None),
    )


class TokenizerManager:
    def __init__(
        self,
        config: ServerConfig,
        tokenizer,
        context_length: int,
        vocab_size: int,
        health: ServerHealth | None = None,
        metrics: RequestMetrics | None = None,
    ):
        self.health = health
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.ctx = zmq.asyncio.Context()
        self.inbox = pull_socket(self.ctx, config.ipc_path(TOKENIZER_MANAGER_IN))
        self.to_scheduler = push_socket(self.ctx, config.ipc_path(SCHEDULER_IN))
        self.states: dict[str, _ReqState] = {}
        self.control_waiters: dict[str, asyncio.Future] = {}
        self._recv_task: asyncio.Task | None = None
        self._closed = False  # close() ran: nothing more is sent or received
        self._health_task: asyncio.Task | None = None
        self._tick_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.output_checker = OutputChecker()
        self.lora = LoRARegistry(config, self.control)
        self.images, self.image_limits = _image_processor(config, tokenizer, vocab_size)
        self.check_retries = config.args.grammar_check_retries
        self.request_timeout = config.args.request_timeout
        self._retry_of: dict[str, str] = {}  # a request's rid -> the rid of its retry now running (for abort)
        self.rid_groups: dict[str, list[str]] = {}  # a client's rid -> the rids of the requests split from it
        self._token_texts: dict[int, str] = {}  # token_text's cache (at most the vocabulary)
        # Grammars whose compile was started ahead of their request lately (prefetch_grammar); data parallelism
        # routes requests to replicas only once they are tokenized, so nothing is prefetched there.
        self._prefetched: OrderedDict[tuple, None] | None = OrderedDict() if config.args.dp_size == 1 else None
        self._prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="prep")
        # A text holds at least len(text) / (longest token's length) tokens: past this it cannot fit the context.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = context_length * max(longest, 1)

    def start(self) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine is shut down")
        if self._recv_task is None:
            self._loop = loop = asyncio.get_running_loop()
            self._recv_task = loop.create_task(self._recv_loop())
            self._tick_task = loop.create_task(self._tick_loop())
            if self.health is not None:
                self._health_task = loop.create_task(self._watch_health())

    def close(self) -> None:
        """Stop receiving and release the sockets and the prep threads (an Engine's shutdown; on its event loop)."""
        for task in (self._recv_task, self._health_task, self._tick_task):
            if task is not None:
                task.cancel()
        self._recv_task = self._health_task = self._tick_task = None
        self._closed = True
        self.ctx.destroy(linger=0)
        self._prep.shutdown(wait=False, cancel_futures=True)

    def prefetch_grammar(self, grammar: GrammarRequest | None) -> None:
        """Have the scheduler start compiling a request's grammar while the request's prompt is still being templated
        and tokenized (the request joins that compile, or finds it done). Once per grammar seen lately: a grammar
        compiled before costs nothing here. Callable from the prep threads too."""
        if grammar is None or self._prefetched is None or self._loop is None or self._closed:
            return
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a prep thread
            on_loop = False
        if on_loop:
            self._send_prefetch(grammar)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed (shutting down): a hint, nothing to do
            self._loop.call_soon_threadsafe(self._send_prefetch, grammar)

    def _send_prefetch(self, grammar: GrammarRequest) -> None:
        key = (grammar.backend, grammar.kind, grammar.text)
        seen = self._prefetched
        if key in seen:
            seen.move_to_end(key)
            return
        seen[key] = None
        if len(seen) > PREFETCH_MEMORY:
            seen.popitem(last=False)
        if not self._closed:
            self.to_scheduler.send_pyobj(GrammarPrefetchReq(grammar))

    def fail_all(self, message: str) -> int:
        """End every request in flight with a 503 (raised by its generator); returns how many there were."""
        for state in self.states.values():
            state.put(EngineUnavailableError(message))
        return len(self.states)

    def fail_all_threadsafe(self, message: str) -> None:
        """fail_all from another thread (the launcher's watchdog and signal handling)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.fail_all, message)

    @property
    def in_flight(self) -> int:
        return len(self.states)

    async def _tick_loop(self) -> None:
        """Wake every request's generator now and then, so that one waiting for its next output still checks its
        client and its deadline (one timer for all, instead of a timeout on every wait)."""
        while True:
            await asyncio.sleep(DISCONNECT_CHECK_S)
            for state in self.states.values():
                state.wake()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_CHECK_S)
            problem = self.health.problem()
            if problem is not None and not (self.health.draining or self.health.warming) and self.states:
                logger.error("%s: failing %d requests in flight", problem, self.fail_all(problem))

    # --- tokenization ------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's ids; `template_kwargs` (a request's chat_template_kwargs) go to the template, and a key that
        names one of the call's own arguments is a 400 like any other template error."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the client's message shapes
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", "messages") from exc
        return self.encode(text, "messages")

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.context_length} tokens. However, your prompt is "
                f"{len(text)} characters long, more than that many tokens can hold.",
                param,
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a request's preparation (template, tokenizing, ...) on the prep threads; the tokenizer releases the
        GIL, so the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args))

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:  # cached: a stream's payloads list every token so far (return_text_in_logprobs)
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    @functools.cached_property
    def _token_bytes(self) -> tuple[bytes | None, ...]:
        return vocab_bytes(self.tokenizer).tokens

    def token_bytes(self, token_id: int) -> list[int]:
        """The bytes a token stands for, as OpenAI's logprobs list them: a token holding part of a character (an
        emoji's first bytes) has its own bytes, where its text is the replacement character."""
        table = self._token_bytes
        raw = table[token_id] if 0 <= token_id < len(table) else None
        return list(raw if raw is not None else self.token_text(token_id).encode())

    # --- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs: int = 0,
        grammar: GrammarRequest | None = None,
        priority: int = 0,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        retry_invalid: bool = False,
        tools: ToolPlan | None = None,
        watch_calls: Callable[[], ChoiceStream] | None = None,
        lora: str | None = None,
        images: tuple[ImageInput, ...] = (),
        replica: int = -1,
        streamed: bool = False,
    ) -> AsyncIterator[GenerateOutput]:
        """Stream one request's outputs (of the LoRA adapter named `lora`, if any; `images`: the prompt's).

        With `retry_invalid` (a client that reads the whole response at once), a constrained output that fails the
        last check is sampled again, up to `--grammar-check-retries` times, before ``invalid_output`` is returned:
        the outputs of an attempt are held until it passes, and only the last attempt's are yielded. `tools`: the
        calls in the output are checked against their tools' schemas. `watch_calls`: a watcher of the output's calls
        (chat_output.ChoiceStream); an attempt ends, as if stopped, where a call repeats an earlier one.
        `streamed`: the outputs go out as an HTTP stream, whose response (Starlette's StreamingResponse) notices a
        client that leaves once it has started, so `is_disconnected` is polled only until the first output (each
        poll costs the event loop about 60 us).

        Trusts `input_ids` and `sampling`: the routes check them once per request (sampling_request.py builds
        validated params, request_checks.check_prompt checks the prompt) and nothing else calls this. The rid
        is checked here, as only this class knows the live ones: a duplicate raises before anything is sent.

        The request metrics (server/metrics.py) are recorded here and in `_attempt`, in the generators that run
        anyway: a wrapping generator would cost every output of every request another resumption."""
        rid = rid or uuid.uuid4().hex
        target = self.output_checker.target(grammar, tools)
        measured = self.metrics is not None and not rid.startswith(WARMUP_RID_PREFIX)  # warm-up requests: not counted
        watch = RequestWatch(self.metrics, grammar.kind if grammar else None) if measured else None
        lora_id = self.lora.acquire(lora)  # an unload waits for this request
        args = (return_logprob, top_logprobs, grammar, priority, is_disconnected, target, watch_calls, watch, lora_id)
        args += (images, replica, streamed)  # replica: data parallelism's pin (the warm-up's); -1 for every other
        try:
            if not (retry_invalid and self.check_retries > 0 and target is not None):
                async for out in self._attempt(rid, input_ids, sampling, *args):
                    if out.finished is not None and watch is not None:
                        watch.finished(out.finished.type)
                    yield out
                return
            async for out in self._with_retries(rid, input_ids, sampling, args):
                if out.finished is not None and watch is not None:
                    watch.finished(out.finished.type)
                yield out
        except Exception as exc:
            if watch is not None:
                _record_failure(watch, exc, grammar)
            raise
        finally:
            self.lora.release(lora)

    async def _with_retries(self, rid: str, input_ids: list[int], sampling: SamplingParams, args: tuple):
        """`generate` for a checked output read whole: attempts until one passes the last check (or the last)."""
        loop = asyncio.get_running_loop()
        # --request-timeout bounds the attempts together: a retry does not start a clock of its own.
        deadline = loop.time() + self.request_timeout if self.request_timeout else None
        try:
            for attempt in range(self.check_retries + 1):
                engine_rid = rid if attempt == 0 else f"{rid}-retry{attempt}"
                if attempt:
                    self._retry_of[rid] = engine_rid
                resampled = _resampled(sampling, attempt)
                outs = [out async for out in self._attempt(engine_rid, input_ids, resampled, *args, deadline=deadline)]
                fin = outs[-1].finished if outs else None
                out_of_time = deadline is not None and loop.time() >= deadline
                last = attempt == self.check_retries or out_of_time  # out of time: the failed attempt is the answer
                if fin is None or fin.type != "invalid_output" or last:
                    if attempt and fin is not None and fin.type == "stop":
                        self.output_checker.stats["recovered"] += 1
                    for out in outs:
                        yield out
                    return
                self.output_checker.stats["retried"] += 1
                logger.info("request %s: sampling again after a failed last check (attempt %d)", rid, attempt + 2)
        finally:
            self._retry_of.pop(rid, None)

    async def _attempt(
        self,
        rid: str,
        input_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool,
        top_logprobs: int,
        grammar: GrammarRequest | None,
        priority: int,
        is_disconnected: Callable[[], Awaitable[bool]] | None,
        target: CheckTarget | None,
        watch_calls: Callable[[], ChoiceStream] | None,
        watch: RequestWatch | None,
        lora_id: int = 0,
        images: tuple[ImageInput, ...] = (),
        replica: int = -1,
        streamed: bool = False,
        deadline: float | None = None,
    ) -> AsyncIterator[GenerateOutput]:
        """One engine request: send it, stream its outputs, check a constrained output at its end. `deadline`: the
        event loop's time past which it ends with a RequestTimeoutError (default: --request-timeout from now)."""
        self.start()
        problem = self.health.problem(rid.startswith(WARMUP_RID_PREFIX)) if self.health is not None else None
        if problem is not None:
            raise EngineUnavailableError(problem)
        if rid in self.states:
            raise InvalidRequestError(f"duplicate request id {rid}", "rid")
        state = _ReqState()
        self.states[rid] = state
        self.to_scheduler.send_pyobj(
            TokenizedGenerateReq(
                rid, input_ids, sampling, return_logprob, top_logprobs, grammar, priority, lora_id, images, replica
            )
        )
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_CHECK_S
        if deadline is None and self.request_timeout:
            deadline = loop.time() + self.request_timeout
        text: list[str] = []  # the output so far, for the last check (checked requests only)
        calls = watch_calls() if watch_calls is not None else None
        started = False  # an output went out (a stream's response has begun)
        try:
            while True:
                items = await state.take()
                if is_disconnected is not None and loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_CHECK_S
                    if await is_disconnected():
                        logger.info("client of %s disconnected; aborting", rid)
                        raise ClientDisconnectedError(rid)
                if deadline is not None and loop.time() > deadline:
                    logger.info("request %s ran past --request-timeout; aborting", rid)
                    raise RequestTimeoutError(
                        f"the request ran longer than the server's limit of {self.request_timeout:g} s"
                    )
                if not items:
                    continue
                failed = next((i for i, item in enumerate(items) if isinstance(item, Exception)), None)
                if failed == 0:  # fail_all: the server cannot finish it
                    raise items[0]
                if failed is not None:  # the outputs before the failure go out first (one may end the request)
                    state.pending[:0] = items[failed:]
                    items = items[:failed]
                repeated = False
                if calls is not None:  # output by output, so that the choice ends exactly where a call repeats
                    for j, item in enumerate(items):
                        if item.finished is None and item.text:
                            calls.feed(item.text)
                            if calls.repeated:
                                items, repeated = items[: j + 1], True
                                break
                out = merge_outputs(items)
                if watch is not None:
                    watch.tokens(len(out.token_ids), out.prompt_tokens)
                fin = out.finished
                if fin is not None and fin.status_code is not None:
                    # An error: the HTTP answer (a whole response drops what was written before it, e.g. by a
                    # grammar that gave up mid-output; so does a stream that has not begun), or a begun stream's
                    # last event after its text so far.
                    state.finished = True
                    if streamed and started and out.token_ids:
                        yield replace(out, finished=None)
                    param = "tools" if isinstance(target, ToolPlan) else grammar.param if grammar else None
                    raise _error_of(fin, param)
                if repeated:  # the choice ends here (chat_output.py): stop the engine request now
                    self.to_scheduler.send_pyobj(AbortReq(rid))
                    state.finished = True
                    out = replace(out, finished=FinishReason("stop"))
                    fin = out.finished
                if target is not None:
                    text.append(out.text)
                    ended = fin is not None and fin.type == "stop" and not isinstance(fin.matched, str)
                    # Calls completed before a cut at max_tokens are returned too: they are checked as well.
                    cut_calls = fin is not None and fin.type == "length" and isinstance(target, ToolPlan)
                    if ended:
                        out = await self._last_check(rid, target, "".join(text), out)
                    elif cut_calls:  # only the calls: an answer cut at max_tokens is not checked (it is "length")
                        out = await self._last_check(rid, replace(target, answer=None, whole=False), "".join(text), out)
                yield out
                started = True
                if out.finished is not None:
                    state.finished = True
                    return
                if streamed:
                    is_disconnected = None  # the stream has started: its response watches the client from now on
        finally:
            self.states.pop(rid, None)
            if not state.finished:
                self.to_scheduler.send_pyobj(AbortReq(rid))

    async def _last_check(self, rid: str, target: CheckTarget, text: str, out: GenerateOutput) -> GenerateOutput:
        """The output ended on its own: if it breaks its schema, it ends as ``invalid_output`` (output_check.py)."""
        result = await self.output_checker.check(target, text)
        if not result.checked and (out.grammar_backend or "").endswith(RELAXED):
            # The grammar left keywords to this check, which did not finish (a pattern that backtracks past its
            # time bound): nothing enforced them, so the output cannot be returned as valid.
            result = replace(result, error="the output could not be checked against the keywords its grammar left out")
        if result.error is None:
            return out
        logger.warning("request %s: constrained output failed the last check: %s", rid, result.error)
        return replace(out, finished=FinishReason("invalid_output", message=result.error))

    async def abort(self, rid: str) -> bool:
        """Abort a request by its rid, or every request of a group (a /generate batch or n > 1) by the group's."""
        found, todo, seen = False, [rid], set()
        while todo:
            one = todo.pop()
            if one in seen:
                continue
            seen.add(one)
            todo.extend(self.rid_groups.get(one, ()))  # a group's members may be groups
            # A completion of several prompts: one group per prompt, `{rid}-{k}` (those done are gone).
            todo.extend(g for g in self.rid_groups if g.startswith(one + "-") and g[len(one) + 1 :].isdigit())
            one = self._retry_of.get(one, one)
            if one in self.states:
                self.to_scheduler.send_pyobj(AbortReq(one))
                found = True
        return found

    @contextlib.contextmanager
    def rid_group(self, rid: str, members: list[str]) -> Iterator[None]:
        """While the block runs, an abort of `rid` aborts every member (requests split from one client request)."""
        self.rid_groups[rid] = members
        try:
            yield
        finally:
            if self.rid_groups.get(rid) is members:
                del self.rid_groups[rid]

    async def control(self, kind: str, args: dict | None = None, timeout: float = 10.0) -> dict:
        self.start()
        qid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[qid] = fut
        self.to_scheduler.send_pyobj(ControlReq(qid, kind, args or {}))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(qid, None)

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.inbox.recv_pyobj()
            try:
                if isinstance(msg, BatchTextOut):
                    self._dispatch(msg)
                elif isinstance(msg, ControlResp):
                    fut = self.control_waiters.get(msg.qid)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.payload)
                else:
                    logger.error("unexpected message %r", type(msg))
            except Exception:  # noqa: BLE001 - keep receiving for every other request
                logger.exception("failed to dispatch a message")

    def _dispatch(self, msg: BatchTextOut) -> None:
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                continue  # already gone (client left)
            state.put(
                GenerateOutput(
                    text=msg.text_deltas[i],
                    token_ids=msg.new_token_ids[i],
                    finished=msg.finished[i],
                    prompt_tokens=msg.prompt_tokens[i],
                    completion_tokens=msg.completion_tokens[i],
                    cached_tokens=msg.cached_tokens[i],
                    logprobs=msg.logprobs[i],
                    grammar_backend=msg.grammar_backends[i] if msg.grammar_backends else None,
                )
            )


def _record_failure(watch: RequestWatch, exc: Exception, grammar: GrammarRequest | None) -> None:
    if isinstance(exc, InvalidRequestError):
        refused = grammar is not None and exc.param in (grammar.param, "tools")
        watch.failed("invalid_request", refusal=str(exc) if refused else None)
    elif isinstance(exc, ServerBusyError):
        watch.failed("queue_full")
    elif isinstance(exc, EngineUnavailableError):
        watch.failed("unavailable")
    elif isinstance(exc, ClientDisconnectedError):
        watch.failed("client_disconnected")
    elif isinstance(exc, RequestTimeoutError):
        watch.failed("timeout")
    else:
        watch.failed("internal")


def _resampled(sampling: SamplingParams, attempt: int) -> SamplingParams:
    """The sampling of a retry: at least RETRY_MIN_TEMPERATURE, a seed of its own (derived from the request's, so a
    seeded request stays reproducible)."""
    if attempt == 0:
        return sampling
    seed = None if sampling.seed is None else (sampling.seed + 7919 * attempt) % (1 << 63)
    return replace(
        sampling,
        temperature=max(sampling.temperature, RETRY_MIN_TEMPERATURE),
        top_k=-1 if sampling.top_k == 1 else sampling.top_k,
        seed=seed,
    )
