"""SGLang's native generation: a GenerateRequest (text or input_ids plus a sampling_params dict) run through the
TokenizerManager, answered as SGLang's {"text", "output_ids", "meta_info"} payload, whole or as a stream of
payloads that each carry the whole output so far; a batch (native_batch.py) as a list of payloads, or one stream of
all their payloads, each with its `index`. Used by the /generate route and by Engine.generate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gramserve.config import ServerArgs
from gramserve.messages import GrammarRequest, TokenLogprob
from gramserve.sampling.params import SamplingParams
from gramserve.server import protocol as P
from gramserve.server.request_checks import check_native_prompt, check_prompt
from gramserve.server.sampling_request import native_sampling_params
from gramserve.server.streaming import interleave, prefetch_first
from gramserve.server.structured_outputs import grammar_from_fields
from gramserve.server.tokenizer_manager import GenerateOutput, TokenizerManager

INLINE_ENCODE_CHARS = 64 * 1024  # longer texts are tokenized off the event loop


@dataclass
class NativeSetup:
    """What a native request turns into before it runs."""

    input_ids: list[int]
    params: SamplingParams
    grammar: GrammarRequest | None


def payload(
    req: P.GenerateRequest,
    text: str,
    ids: list[int],
    out: GenerateOutput,
    lps: list[TokenLogprob],
    token_text: Callable[[int], str],
) -> dict:
    meta = {
        "id": req.rid,  # the client's rid, or the one native_batch gave it
        "finish_reason": out.finished.to_json() if out.finished else None,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "grammar_backend": out.grammar_backend,
    }
    if req.return_logprob and req.return_text_in_logprobs:  # SGLang's [logprob, id, text]
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, token_text(lp.token_id)] for lp in lps]
        meta["output_top_logprobs"] = [[[v, i, token_text(i)] for i, v in lp.top] for lp in lps]
    elif req.return_logprob:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in lps]
        meta["output_top_logprobs"] = [[[v, i] for i, v in lp.top] for lp in lps]
    return {"text": text, "output_ids": ids, "meta_info": meta}


class NativeServing:
    def __init__(self, args: ServerArgs, tm: TokenizerManager):
        self.args = args
        self.tm = tm

    async def prepare(self, req: P.GenerateRequest) -> NativeSetup:
        """Check the request, tokenize its text, build its sampling params and grammar (errors raise here)."""
        tm = self.tm
        check_native_prompt(req)
        if req.input_ids is not None:
            input_ids = req.input_ids
        elif len(req.text) > INLINE_ENCODE_CHARS:
            input_ids = await tm.off_loop(tm.encode, req.text)
        else:
            input_ids = tm.encode(req.text)
        sampling = dict(req.sampling_params)
        fields = {k: sampling.pop(k) for k in list(sampling) if k in P.NATIVE_GRAMMAR_KEYS}
        grammar = grammar_from_fields(fields, self.args)
        params = native_sampling_params(sampling, tm.vocab_size)
        check_prompt(input_ids, params.max_new_tokens, tm.vocab_size, tm.context_length, "prompt")
        return NativeSetup(input_ids, params, grammar)

    async def _outputs(self, req: P.GenerateRequest, is_disconnected, whole: bool) -> AsyncIterator[GenerateOutput]:
        lora = self.tm.lora.adapter_for(None, req.lora_path)
        setup = await self.prepare(req)
        return await prefetch_first(  # engine errors before the first token raise here, not inside a stream
            self.tm.generate(
                setup.input_ids,
                setup.params,
                rid=req.rid,
                return_logprob=req.return_logprob,
                top_logprobs=req.top_logprobs_num,
                grammar=setup.grammar,
                priority=req.priority,
                is_disconnected=is_disconnected,
                retry_invalid=whole,
                lora=lora,
                streamed=not whole,
            )
        )

    async def generate(self, req: P.GenerateRequest, is_disconnected=None) -> dict:
        """The whole answer (a constrained output that fails the last check is sampled again)."""
        gen = await self._outputs(req, is_disconnected, whole=True)
        text, ids, lps, last = "", [], [], None
        try:
            async for out in gen:
                text += out.text
                ids += out.token_ids
                lps += out.logprobs or []
                last = out
        finally:
            await gen.aclose()
        return payload(req, text, ids, last, lps, self.tm.token_text)

    async def generate_stream(self, req: P.GenerateRequest, is_disconnected=None) -> AsyncIterator[dict]:
        """Validates eagerly (errors raise before the first payload), then returns the payloads, each carrying the
        whole output so far, as SGLang's do."""
        return _payloads(req, await self._outputs(req, is_disconnected, whole=False), self.tm.token_text)

    async def generate_many(self, reqs: list[P.GenerateRequest], is_disconnected=None) -> list[dict]:
        """The answers of single requests run at once (a batch), in their order; the first failure raises and the
        others are aborted."""
        return await gather_all(lambda r: self.generate(r, is_disconnected), reqs)

    async def generate_many_stream(self, reqs: list[P.GenerateRequest], is_disconnected=None) -> AsyncIterator[dict]:
        """Every request's payloads as they come, each with its request's `index`; every request is validated and
        has its first output before the stream starts (errors raise here)."""
        outputs = await gather_all(lambda r: self._outputs(r, is_disconnected, whole=False), reqs, close=True)

        async def payloads() -> AsyncIterator[dict]:
            try:
                streams = [_payloads(r, out, self.tm.token_text) for r, out in zip(reqs, outputs)]
                async for index, item in interleave(streams):
                    yield {**item, "index": index}
            finally:
                for out in outputs:
                    await out.aclose()

        return payloads()


async def _payloads(
    req: P.GenerateRequest, outputs: AsyncIterator[GenerateOutput], token_text: Callable[[int], str]
) -> AsyncIterator[dict]:
    """A request's payloads, each with the whole output so far."""
    text, ids, lps = "", [], []
    try:
        async for out in outputs:
            text += out.text
            ids = ids + out.token_ids  # a new list each time: a payload handed out must not grow after
            lps = lps + (out.logprobs or [])
            yield payload(req, text, ids, out, lps, token_text)
    finally:
        await outputs.aclose()


async def gather_all(one: Callable[[Any], Awaitable[Any]], items: list, close: bool = False) -> list:
    """`one(item)` for every item at once, the results in order; the first failure cancels the others and raises.
    `close`: the results are streams (streaming.Prefetched), closed if another call fails (their engine requests are
    aborted)."""
    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        if close:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is None:
                    await t.result().aclose()
        raise
