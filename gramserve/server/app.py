"""The FastAPI app: routes, OpenAI-style error responses, and SGLang's native /generate."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gramserve.config import ServerArgs
from gramserve.server import protocol as P
from gramserve.server.error_handlers import error_response, register_error_handlers
from gramserve.server.errors import InvalidRequestError, ModelNotServedError
from gramserve.server.openai_serving import OpenAIServing, prefetch_first
from gramserve.server.request_checks import check_native_prompt, check_prompt
from gramserve.server.sampling_request import native_sampling_params
from gramserve.server.structured_outputs import grammar_from_fields
from gramserve.server.tokenizer_manager import TokenizerManager


_NATIVE_GRAMMAR_KEYS = {"json_schema", "regex", "ebnf", "structural_tag", "choice", "grammar_backend",
                        "response_format", "structured_outputs"}


def create_app(args: ServerArgs, tm: TokenizerManager, runner_info: dict) -> FastAPI:
    app = FastAPI(title="gramserve", version="0.1.0")
    serving = OpenAIServing(tm, args)

    @app.on_event("startup")
    async def _start() -> None:
        tm.start()

    register_error_handlers(app)

    def check_model(name: str | None) -> None:
        if name is not None and name not in (args.model_name, "default"):
            raise ModelNotServedError(f"The model `{name}` does not exist. This server serves `{args.model_name}`.")

    async def parse(request: Request, model_cls):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidRequestError("the request body is not valid JSON")
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        from pydantic import ValidationError

        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc

    # --- OpenAI ---------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, P.ChatCompletionRequest)
        check_model(req.model)
        if req.stream:
            stream = await serving.chat_stream(req, request.is_disconnected)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse((await serving.chat(req, request.is_disconnected)).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, P.CompletionRequest)
        check_model(req.model)
        if req.stream:
            stream = await serving.completions_stream(req, request.is_disconnected)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse((await serving.completions(req, request.is_disconnected)).model_dump())

    @app.get("/v1/models")
    async def models():
        card = P.ModelCard(id=args.model_name, root=runner_info.get("model_path"),
                           max_model_len=runner_info.get("context_length"))
        return JSONResponse(P.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        card = P.ModelCard(id=args.model_name, root=runner_info.get("model_path"),
                           max_model_len=runner_info.get("context_length"))
        return JSONResponse(card.model_dump())

    # --- native ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info():
        info = await tm.control("server_info")
        return JSONResponse({"server_args": args.to_dict(), "model_name": args.model_name, **info})

    @app.post("/generate")
    async def generate(request: Request):
        req = await parse(request, P.GenerateRequest)
        check_native_prompt(req)
        input_ids = req.input_ids if req.input_ids is not None else tm.encode(req.text)
        sampling = dict(req.sampling_params)
        grammar_fields = {k: sampling.pop(k) for k in list(sampling) if k in _NATIVE_GRAMMAR_KEYS}
        grammar = grammar_from_fields(grammar_fields, args)
        params = native_sampling_params(sampling, tm.vocab_size)
        check_prompt(input_ids, params.max_new_tokens, tm.vocab_size, tm.context_length)
        gen = await prefetch_first(tm.generate(
            input_ids, params, rid=req.rid, return_logprob=req.return_logprob, top_logprobs=req.top_logprobs_num,
            grammar=grammar, priority=req.priority, is_disconnected=request.is_disconnected))

        def payload(text: str, ids: list[int], out, lps: list) -> dict:
            meta = {"id": req.rid, "finish_reason": out.finished.to_json() if out.finished else None,
                    "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                    "cached_tokens": out.cached_tokens, "grammar_backend": out.grammar_backend}
            if req.return_logprob:
                meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in lps]
                meta["output_top_logprobs"] = [[[v, i] for i, v in lp.top] for lp in lps]
            return {"text": text, "output_ids": ids, "meta_info": meta}

        if req.stream:
            async def stream():
                text, ids, lps = "", [], []
                try:
                    async for out in gen:
                        text += out.text
                        ids += out.token_ids
                        lps += out.logprobs or []
                        yield f"data: {json.dumps(payload(text, ids, out, lps))}\n\n"
                finally:
                    await gen.aclose()
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        text, ids, lps, last = "", [], [], None
        async for out in gen:
            text += out.text
            ids += out.token_ids
            lps += out.logprobs or []
            last = out
        return JSONResponse(payload(text, ids, last, lps))

    @app.post("/flush_cache")
    async def flush_cache():
        result = await tm.control("flush_cache")
        if not result.get("ok"):
            return error_response(400, result.get("error", "cannot flush the cache"))
        return JSONResponse({"ok": True, "message": "prefix cache flushed"})

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json()
        rid = body.get("rid") if isinstance(body, dict) else None
        if not rid:
            raise InvalidRequestError("rid is required", "rid")
        found = await tm.abort(rid)
        return JSONResponse({"rid": rid, "aborted": found}, status_code=200 if found else 404)

    return app
