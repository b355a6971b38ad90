"""The OpenAI layer: chat and text completions on top of the TokenizerManager, streaming and not.

`n > 1` fans out into n engine requests (each its own seed when seeded: `choice_seed`) whose streams are merged by
choice index.
"""

from __future__ import annotations

import asyncio
import codecs
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

from gramserve.config import ServerConfig
from gramserve.messages import GrammarRequest, ImageInput, TokenLogprob
from gramserve.multimodal.images import ImageError
from gramserve.parsers.reasoning import ReasoningParser, get_reasoning_parser
from gramserve.parsers.tool_calls import get_tool_call_parser
from gramserve.sampling.params import SamplingParams, choice_seed
from gramserve.server import protocol as P
from gramserve.server.chat_output import ChoiceStream, DeltaFields, final_output, finish_reason
from gramserve.server.errors import InvalidRequestError
from gramserve.server.request_body import body_bytes
from gramserve.server.request_checks import (
    chat_top_logprobs,
    check_chat_messages,
    check_completion_options,
    check_openai_options,
    check_prompt,
    check_text_output,
)
from gramserve.server.request_id import engine_rid_base, response_id
from gramserve.server.sampling_request import openai_sampling_params
from gramserve.server.streaming import interleave, prefetch_first, sse_stream
from gramserve.server.structured_outputs import checked_backend, grammar_from_fields, with_schema_in_prompt
from gramserve.server.tokenizer_manager import GenerateOutput, TokenizerManager
from gramserve.server.tool_requests import (
    ToolPlan,
    call_markers,
    calls_or_answer_grammar,
    plan_tools,
    render_messages,
    template_supports_tools,
    template_takes_content_parts,
    tool_grammar,
)

INLINE_PREP_BYTES = 64 * 1024  # request bodies up to this size are prepared on the event loop (see _prepare)


def _params_for_choice(base: SamplingParams, i: int) -> SamplingParams:
    if base.seed is None or i == 0:
        return base
    return replace(base, seed=choice_seed(base.seed, i))


@dataclass
class ChatSetup:
    """Everything a chat request turns into before it runs."""

    input_ids: list[int]
    params: SamplingParams
    top_logprobs: int | None
    grammar: GrammarRequest | None
    tools: ToolPlan | None
    grammar_is_tools: bool  # the grammar is the tools' (tool_grammar): the calls' arguments get the last check
    reasoning_cls: type[ReasoningParser] | None
    template_kwargs: dict[str, Any]
    lora: str | None = None  # the LoRA adapter the request names
    images: tuple[ImageInput, ...] = ()  # the prompt's images (vision-language models)

    def reasoning(self) -> ReasoningParser | None:
        return self.reasoning_cls(self.template_kwargs) if self.reasoning_cls is not None else None


def _has_images(req) -> bool:
    messages = getattr(req, "messages", None) or []
    return any(
        not isinstance(m.content, str) and any(part.type == "image_url" for part in m.content or []) for m in messages
    )


@dataclass
class CompletionSetup:
    """Everything a completions request turns into before it runs: one token prompt per choice group."""

    prompts: list[list[int]]
    params: SamplingParams
    grammar: GrammarRequest | None
    lora: str | None = None  # the LoRA adapter the request names


class TextOffsets:
    """The `text_offset` of a completion's next token: characters decoded so far from its tokens' bytes, a split
    character counted once it is whole."""

    def __init__(self) -> None:
        self.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def advance(self, token: bytes) -> int:
        """The offset of this token (then moved past it)."""
        at = self.offset
        self.offset += len(self.chars.decode(token))
        return at


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, config: ServerConfig):
        self.tm = tm
        self.args = args = config.args
        self.model_name = args.model_name
        self.max_n = args.max_n
        chat_template = getattr(tm.tokenizer, "chat_template", None)
        if isinstance(chat_template, dict):  # several named templates (e.g. "default", "tool_use")
            chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
        self.native_tools = template_supports_tools(chat_template)
        # a vision-language template that reads content parts gets them (it writes the image tokens itself)
        self.content_parts = tm.images is not None and template_takes_content_parts(chat_template)
        self.tool_parser = config.launch.tool_call_parser  # checked by the launcher (resolve_parsers)
        self.reasoning_cls = get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None

    def grammar(self, req: P.SamplingFields) -> GrammarRequest | None:
        return grammar_from_fields(req.model_dump(), self.args)

    # --- shared helpers ---------------------------------------------------------------------------

    async def _prepare(self, setup: Callable, req):
        """Run a request's setup (checks, template, tokenization, grammar text). A small request's takes well under
        a millisecond and runs here; a large body's runs on the prep threads, so it cannot stall the event loop (and
        small requests do not pay a thread hop and the GIL hand-offs that come with it)."""
        if body_bytes() > INLINE_PREP_BYTES or _has_images(req):  # images: decoding, maybe fetching
            return await self.tm.off_loop(setup, req)
        return setup(req)

    def _check_prompt(self, input_ids: list[int], params: SamplingParams, param: str = "messages") -> None:
        check_prompt(input_ids, params.max_new_tokens, self.tm.vocab_size, self.tm.context_length, param)

    async def _merged(
        self,
        input_ids: list[int],
        params: SamplingParams,
        n: int,
        rid: str,
        logprobs: int | None,
        is_disconnected,
        grammar: GrammarRequest | None = None,
        priority: int = 0,
        whole: bool = False,
        tools: ToolPlan | None = None,
        watch_calls: Callable[[], ChoiceStream] | None = None,
        lora: str | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """Run n engine requests (prompt and params already checked) and yield (choice index, output) as they
        arrive. `whole`: the response is sent whole (not streamed), so a constrained output that fails the last
        check may be sampled again (TokenizerManager.generate). `tools`: the calls' arguments are checked too;
        `watch_calls`: a choice ends at a repeated call."""
        base = engine_rid_base(rid)
        # /abort_request with the response's id (what the client sees) aborts every choice.
        with self.tm.rid_group(rid, [f"{base}-{i}" for i in range(n)]):
            gens = [
                self.tm.generate(
                    input_ids,
                    _params_for_choice(params, i),
                    rid=f"{base}-{i}",
                    return_logprob=logprobs is not None,
                    top_logprobs=logprobs or 0,
                    grammar=grammar,
                    priority=priority,
                    is_disconnected=is_disconnected,
                    retry_invalid=whole,
                    tools=tools,
                    watch_calls=watch_calls,
                    lora=lora,
                    images=images,
                    streamed=not whole,
                )
                for i in range(n)
            ]
            if n == 1:
                try:
                    async for out in gens[0]:
                        yield 0, out
                finally:
                    await gens[0].aclose()  # abort at once when our consumer goes away
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, gen) -> None:
                try:
                    async for out in gen:
                        await queue.put((i, out))
                except Exception as exc:  # noqa: BLE001 - surfaced to the consumer below
                    await queue.put((i, exc))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
            try:
                done = 0
                while done < n:
                    i, item = await queue.get()
                    if item is None:
                        done += 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()  # a pump's generator then ends in its task (its engine request is aborted there)
                for g in gens:
                    if not g.ag_running:  # one never started, or already done
                        await g.aclose()

    def _usage(self, prompt_tokens: int, completion: int, cached: int) -> P.UsageInfo:
        return P.UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached),
        )

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> list[P.ChatLogprobToken]:
        items = []
        for lp in lps:
            tok = self.tm.token_text(lp.token_id)
            items.append(
                P.ChatLogprobToken(
                    token=tok,
                    logprob=lp.logprob,
                    bytes=self.tm.token_bytes(lp.token_id),
                    top_logprobs=[
                        P.TopLogprob(token=self.tm.token_text(i), logprob=v, bytes=self.tm.token_bytes(i))
                        for i, v in lp.top
                    ],
                )
            )
        return items

    # --- chat ---------------------------------------------------------------------------------

    def model_of(self, setup: ChatSetup | CompletionSetup) -> str:
        """The `model` a response names: the adapter the request used, else the base model."""
        return setup.lora or self.model_name

    def _chat_setup(self, req: P.ChatCompletionRequest) -> ChatSetup:
        lora = self.tm.lora.adapter_for(req.model, req.lora_path)
        check_openai_options(req, self.max_n)
        top = chat_top_logprobs(req)
        params = openai_sampling_params(req, self.tm.vocab_size)
        grammar = self.grammar(req)
        plan = plan_tools(req, self.tool_parser, self.args)
        grammar_is_tools = False
        if plan is not None and plan.parses_calls:
            forced = plan.mode in ("required", "named")
            if grammar is None or (forced and grammar.kind in ("json_schema", "json_object")):
                # A forced call writes no text answer for a JSON response format to shape (the OpenAI Agents SDK
                # sends both: tool_choice required and its output_type's schema): the calls' grammar holds.
                backend = checked_backend(req.grammar_backend or self.args.grammar_backend)
                grammar, grammar_is_tools = tool_grammar(plan, self.args, backend), True
            elif forced:
                raise InvalidRequestError(
                    "tool_choice required or a named function cannot be combined with a regex, grammar or "
                    "structural-tag constraint",
                    "tool_choice",
                )
            elif (either := calls_or_answer_grammar(plan, grammar, self.args)) is not None:
                # auto plus a JSON response format: calls, or a text answer in the format
                plan, grammar, grammar_is_tools = replace(plan, answer=grammar), either, True
            # auto plus another constraint (regex, a grammar): it constrains the whole output; calls are parsed.
            if params.stop:  # stop strings end the text answer, never a call (OpenAI)
                if forced:  # the output is calls only
                    params = replace(params, stop=())
                else:
                    params = replace(params, stop_until=call_markers(plan))
        kwargs = dict(req.chat_template_kwargs or {})
        if "chat_template" in kwargs and not self.args.allow_request_chat_template:
            raise InvalidRequestError(
                "a request-supplied chat template is not allowed on this server (--allow-request-chat-template)",
                "chat_template_kwargs",
            )
        if grammar is not None and self.reasoning_cls is not None and self.reasoning_cls(kwargs).thinking:
            # The model thinks first: the constraint applies from the end of its reasoning on.
            grammar = replace(grammar, start_after=self.reasoning_cls.end_marker)
        check_chat_messages(req)
        check_text_output(req)
        self.tm.prefetch_grammar(grammar)  # it compiles while the messages are rendered and tokenized
        processor, urls = self.tm.images, []
        messages, tools = render_messages(
            req.messages,
            plan,
            self.native_tools,
            get_tool_call_parser(self.tool_parser),
            image_token=processor.image_token if processor is not None else None,
            images=urls,
            content_parts=self.content_parts,
        )
        if self.args.grammar_schema_in_prompt and grammar is not None and grammar.kind == "json_schema":
            messages = with_schema_in_prompt(messages, grammar.text)
        if tools is not None:
            kwargs["tools"] = tools
        # vLLM's two template switches are accepted inside chat_template_kwargs too
        add_generation_prompt = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", req.continue_final_message)
        if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
            raise InvalidRequestError(
                "add_generation_prompt and continue_final_message must be booleans", "chat_template_kwargs"
            )
        input_ids = self.tm.apply_chat_template(messages, add_generation_prompt, continue_final_message, kwargs)
        images: tuple[ImageInput, ...] = ()
        if processor is not None:  # also without images: an image token typed in a text part is refused
            input_ids, images = self._images(input_ids, urls)
        if plan is not None and plan.parses_calls and "skip_special_tokens" not in req.model_fields_set:
            # Call markers are special tokens in some tokenizers ([TOOL_CALLS], DeepSeek's, Kimi's): keep
            # them in the text the parser reads (the EOS that ends the answer is dropped anyway).
            params = replace(params, skip_special_tokens=False)
        self._check_prompt(input_ids, params)
        reasoning_cls = self.reasoning_cls if req.separate_reasoning else None
        return ChatSetup(
            input_ids,
            params,
            top,
            grammar,
            plan,
            grammar_is_tools,
            reasoning_cls,
            dict(req.chat_template_kwargs or {}),
            lora,
            images,
        )

    def _images(self, input_ids: list[int], urls: list[str]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Read and process a chat's images (a prep thread: _prepare sends requests with images there)."""
        limit = self.args.max_images_per_request
        if len(urls) > limit:
            raise InvalidRequestError(f"{len(urls)} images in one request; the limit is {limit}", "messages")
        try:
            pictures = [self.tm.images.load(url, self.tm.image_limits) for url in urls]
            return self.tm.images.expand(input_ids, pictures)
        except ImageError as exc:
            raise InvalidRequestError(str(exc), "messages", status=exc.status) from None

    def _chat_requests(self, setup: ChatSetup, req: P.ChatCompletionRequest, rid: str, is_disconnected, whole: bool):
        """The merged outputs of a chat request's n engine requests."""
        return self._merged(
            setup.input_ids,
            setup.params,
            req.n,
            rid,
            setup.top_logprobs,
            is_disconnected,
            setup.grammar,
            req.priority,
            whole=whole,
            tools=setup.tools if setup.grammar_is_tools else None,
            watch_calls=(lambda: ChoiceStream(setup.tools, setup.reasoning())) if setup.tools is not None else None,
            lora=setup.lora,
            images=setup.images,
        )

    async def chat(self, req: P.ChatCompletionRequest, is_disconnected) -> P.ChatCompletionResponse:
        setup = await self._prepare(self._chat_setup, req)
        top = setup.top_logprobs
        rid = response_id("chatcmpl")
        texts = [""] * req.n
        lps: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
        finals: list[GenerateOutput | None] = [None] * req.n
        # Which choices ended at a repeated call (their engine requests end there: TokenizerManager.generate).
        watchers = [ChoiceStream(setup.tools, setup.reasoning()) for _ in range(req.n)] if setup.tools else None
        repeated = [False] * req.n
        async for i, out in self._chat_requests(setup, req, rid, is_disconnected, whole=True):
            texts[i] += out.text
            lps[i] += out.answer_logprobs
            finals[i] = out
            if watchers is not None and out.text:
                watchers[i].feed(out.text)
                repeated[i] = watchers[i].repeated
        choices = []
        for i, out in enumerate(finals):
            cut = repeated[i] or out.finish_reason in ("length", "abort")
            parsed = final_output(texts[i], setup.tools, setup.reasoning(), cut=cut)
            choices.append(
                P.ChatChoice(
                    index=i,
                    message=P.ChatResponseMessage(
                        content=parsed.content, tool_calls=parsed.tool_calls, reasoning_content=parsed.reasoning_content
                    ),
                    logprobs=P.ChatLogprobs(content=self._chat_logprobs(lps[i])) if top is not None else None,
                    finish_reason=finish_reason(out.finish_reason, setup.tools, bool(parsed.tool_calls)),
                    matched_stop=out.matched_stop,
                )
            )
        completion = sum(o.completion_tokens for o in finals)
        usage = self._usage(finals[0].prompt_tokens, completion, finals[0].cached_tokens)
        return P.ChatCompletionResponse(
            id=rid, model=self.model_of(setup), choices=choices, usage=usage, grammar_backend=finals[0].grammar_backend
        )

    async def chat_stream(self, req: P.ChatCompletionRequest, is_disconnected) -> AsyncIterator[str]:
        """Validates eagerly (errors raise before the first byte), then returns the SSE stream."""
        return sse_stream(await self.chat_chunks(req, is_disconnected))

    async def chat_chunks(self, req: P.ChatCompletionRequest, is_disconnected) -> AsyncIterator[P.ChatCompletionChunk]:
        """Validates eagerly (errors raise here), then returns the stream's chunks (a failure midway raises)."""
        setup = await self._prepare(self._chat_setup, req)
        top = setup.top_logprobs
        rid = response_id("chatcmpl")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        merged = await prefetch_first(self._chat_requests(setup, req, rid, is_disconnected, whole=False))
        choice_streams = [ChoiceStream(setup.tools, setup.reasoning()) for _ in range(req.n)]

        async def chunks() -> AsyncIterator:
            totals = [0] * req.n
            prompt = cached = 0
            ended = [False] * req.n  # a choice that repeated a call ends before its engine request does
            try:
                for i in range(req.n):
                    yield P.ChatCompletionChunk(
                        id=rid,
                        model=self.model_of(setup),
                        choices=[P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))],
                    )
                async for i, out in merged:
                    if ended[i]:
                        continue
                    totals[i], prompt, cached = out.completion_tokens, out.prompt_tokens, out.cached_tokens
                    cs = choice_streams[i]
                    fields = cs.feed(out.text) if out.text else DeltaFields()
                    base_reason = out.finish_reason
                    if cs.repeated:  # the engine request ended here too: stop, or invalid_output from the last check
                        ended[i], base_reason = True, base_reason or "stop"
                    elif out.finished is not None:
                        tail = cs.finish(cut=base_reason in ("length", "abort"))
                        fields.reasoning_content += tail.reasoning_content
                        fields.content += tail.content
                        fields.tool_calls += tail.tool_calls
                    if not fields and base_reason is None and not out.answer_logprobs:
                        continue
                    choice = P.ChatStreamChoice(
                        index=i,
                        delta=fields.message(),
                        logprobs=P.ChatLogprobs(content=self._chat_logprobs(out.answer_logprobs))
                        if top is not None
                        else None,
                        finish_reason=finish_reason(base_reason, setup.tools, cs.calls_made > 0),
                        matched_stop=out.matched_stop if out.finished is not None else None,
                    )
                    usage = self._usage(prompt, totals[i], cached) if continuous else None
                    backend = out.grammar_backend if choice.finish_reason is not None else None
                    yield P.ChatCompletionChunk(
                        id=rid, model=self.model_of(setup), choices=[choice], usage=usage, grammar_backend=backend
                    )
                if include_usage:
                    yield P.ChatCompletionChunk(
                        id=rid, model=self.model_of(setup), choices=[], usage=self._usage(prompt, sum(totals), cached)
                    )
            finally:
                await merged.aclose()

        return chunks()

    # --- completions --------------------------------------------------------------------------

    def _completion_prompts(self, req: P.CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [self.tm.encode(p)]
        if not p:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        many = not all(isinstance(x, int) for x in p)
        if many and len(p) * req.n > self.max_n:  # each prompt x each choice is one engine request
            raise InvalidRequestError(
                f"{len(p)} prompts x n={req.n} is more than the {self.max_n} completions one request may ask for "
                "(--max-n)",
                "prompt",
            )
        if not many:
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return [self.tm.encode(x) for x in p]
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise InvalidRequestError("prompt must be a string, a list of strings, or token ids", "prompt")

    def _completion_setup(self, req: P.CompletionRequest) -> CompletionSetup:
        lora = self.tm.lora.adapter_for(req.model, req.lora_path)
        check_openai_options(req, self.max_n)
        check_completion_options(req)
        params = openai_sampling_params(req, self.tm.vocab_size)
        grammar = self.grammar(req)
        self.tm.prefetch_grammar(grammar)  # it compiles while the prompts are tokenized
        prompts = self._completion_prompts(req)
        for ids in prompts:  # every prompt before any is sent
            self._check_prompt(ids, params, "prompt")
        return CompletionSetup(prompts, params, grammar, lora)

    def _completion_logprobs(self, lps: list[TokenLogprob], offsets: TextOffsets) -> P.CompletionLogprobs:
        """`text_offset` counts the characters of the text before each token: a token holding part of a character
        starts where that character does (`offsets` carries a split character from one streamed chunk to the next).
        A token that is not whole characters is written `bytes:\\xNN...` (OpenAI's form)."""
        out = P.CompletionLogprobs()
        for lp in lps:
            out.tokens.append(self._token_label(lp.token_id))
            out.token_logprobs.append(lp.logprob)
            top = {self._token_label(i): v for i, v in lp.top}
            top.setdefault(out.tokens[-1], lp.logprob)  # as OpenAI: the sampled token too (up to logprobs + 1)
            out.top_logprobs.append(top)
            out.text_offset.append(offsets.advance(bytes(self.tm.token_bytes(lp.token_id))))
        return out

    def _token_label(self, token_id: int) -> str:
        raw = bytes(self.tm.token_bytes(token_id))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return self.tm.token_text(token_id)

    async def completions(self, req: P.CompletionRequest, is_disconnected) -> P.CompletionResponse:
        setup = await self._prepare(self._completion_setup, req)
        rid = response_id("cmpl")
        choices, prompt_total, completion_total, cached_total = [], 0, 0, 0

        async def one(pi: int, ids: list[int]):
            texts = [""] * req.n
            lps: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
            finals: list[GenerateOutput | None] = [None] * req.n
            async for i, out in self._merged(
                ids,
                setup.params,
                req.n,
                f"{rid}-{pi}",
                req.logprobs,
                is_disconnected,
                setup.grammar,
                req.priority,
                whole=True,
                lora=setup.lora,
            ):
                texts[i] += out.text
                lps[i] += out.answer_logprobs
                finals[i] = out
            return texts, lps, finals

        # several prompts run concurrently; choices ordered by prompt
        results = await asyncio.gather(*(one(pi, ids) for pi, ids in enumerate(setup.prompts)))
        for pi, (texts, lps, finals) in enumerate(results):
            prompt_total += finals[0].prompt_tokens
            cached_total += finals[0].cached_tokens
            for i in range(req.n):
                completion_total += finals[i].completion_tokens
                choices.append(
                    P.CompletionChoice(
                        index=pi * req.n + i,
                        text=texts[i],
                        logprobs=self._completion_logprobs(lps[i], TextOffsets()) if req.logprobs is not None else None,
                        finish_reason=finals[i].finish_reason,
                        matched_stop=finals[i].matched_stop,
                    )
                )
        return P.CompletionResponse(
            id=rid,
            model=self.model_of(setup),
            choices=choices,
            usage=self._usage(prompt_total, completion_total, cached_total),
            grammar_backend=results[0][2][0].grammar_backend,
        )

    async def completions_stream(self, req: P.CompletionRequest, is_disconnected) -> AsyncIterator[str]:
        """Validates eagerly (errors raise before the first byte), then returns the SSE stream."""
        return sse_stream(await self.completion_chunks(req, is_disconnected))

    async def completion_chunks(self, req: P.CompletionRequest, is_disconnected) -> AsyncIterator[P.CompletionResponse]:
        """Validates eagerly (errors raise here), then returns the stream's chunks (a failure midway raises)."""
        setup = await self._prepare(self._completion_setup, req)
        rid = response_id("cmpl")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prompts, n = setup.prompts, req.n
        streams = [
            self._merged(
                ids,
                setup.params,
                n,
                rid if len(prompts) == 1 else f"{rid}-{pi}",
                req.logprobs,
                is_disconnected,
                setup.grammar,
                req.priority,
                lora=setup.lora,
            )
            for pi, ids in enumerate(prompts)
        ]
        # Several prompts run together; each one's first output is awaited before the response starts (errors are
        # plain HTTP errors), and their choices are numbered by prompt, then by n (as without streaming).
        firsts = await asyncio.gather(*(prefetch_first(stream) for stream in streams), return_exceptions=True)
        errors = [r for r in firsts if isinstance(r, BaseException)]
        if errors:
            for first, stream in zip(firsts, streams):
                await (stream if isinstance(first, BaseException) else first).aclose()
            raise errors[0]
        merged = interleave(firsts)

        async def chunks() -> AsyncIterator:
            totals = [0] * (len(prompts) * n)
            offsets = [TextOffsets() for _ in range(len(prompts) * n)]
            prompt_tokens, cached = [0] * len(prompts), [0] * len(prompts)
            try:
                async for pi, (i, out) in merged:
                    index = pi * n + i
                    totals[index], prompt_tokens[pi], cached[pi] = (
                        out.completion_tokens,
                        out.prompt_tokens,
                        out.cached_tokens,
                    )
                    if not out.text and out.finished is None and (req.logprobs is None or not out.answer_logprobs):
                        continue  # a token holding part of a character: its logprob goes out, its text waits
                    lp = None
                    if req.logprobs is not None:
                        lp = self._completion_logprobs(out.answer_logprobs, offsets[index])
                    yield P.CompletionResponse(
                        id=rid,
                        model=self.model_of(setup),
                        choices=[
                            P.CompletionChoice(
                                index=index,
                                text=out.text,
                                logprobs=lp,
                                finish_reason=out.finish_reason,
                                matched_stop=out.matched_stop,
                            )
                        ],
                        grammar_backend=out.grammar_backend if out.finished is not None else None,
                    )
                if include_usage:
                    usage = self._usage(sum(prompt_tokens), sum(totals), sum(cached))
                    yield P.CompletionResponse(id=rid, model=self.model_of(setup), choices=[], usage=usage)
            finally:
                await merged.aclose()

        return chunks()
