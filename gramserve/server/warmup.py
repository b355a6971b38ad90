"""Warm-up before /health turns 200: requests of every kind the configuration serves, sent down the same path as a
client's (TokenizerManager -> scheduler -> detokenizer), so that kernels are compiled (Triton, FlashInfer's JIT),
caches filled and lazy initializations done before the first user request rather than inside it.

The cases cover prefill (short, over a cached prefix, a chunked long prompt), decode at several batch sizes, every
sampling path (greedy, top-k / top-p, seeded, penalties and bias, logprobs), grammar masks (a JSON schema, a
regex), with LoRA adapters an adapter's requests, with a vision-language model requests with an image. While they
run /health and new requests answer 503 "warming up"; the log shows a progress bar and what each case took.
`--skip-warmup` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass

from gramserve.messages import GrammarRequest
from gramserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_RID_PREFIX = "warmup-"
_TEXT = (
    "Warm-up: the quick brown fox jumps over the lazy dog while the scheduler, the detokenizer and the grammar "
    "process get ready for the first request. "
)
_SCHEMA = (
    '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", '
    '"minimum": 0, "maximum": 120}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, '
    '"required": ["name", "age"], "additionalProperties": false}'
)


@dataclass(frozen=True)
class WarmupCase:
    name: str
    prompt_tokens: int
    sampling: SamplingParams
    copies: int = 1  # sent at once: decode batch sizes
    grammar: GrammarRequest | None = None
    top_logprobs: int = 0
    prompt_offset: int = 0  # where in the warm-up text the prompt starts (0: shares the other prompts' prefix)
    lora: str | None = None  # a LoRA adapter's name
    image: bool = False  # a vision-language model: the prompt holds an image (the vision tower's kernels)


def warmup_cases(device: str, context_length: int, chunk: int, max_running: int) -> list[WarmupCase]:
    """On a GPU every path compiles kernels on first use (Triton, FlashInfer's JIT): all of them run. On a CPU the
    kernels are built before the model loads and torch runs eagerly; what is left to warm there is the first
    request itself (a prefill and decode) and the grammar backends' first compile."""
    new = 8
    greedy = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    json_case = WarmupCase(
        "JSON schema",
        16,
        SamplingParams(max_new_tokens=2 * new, temperature=0.0),
        grammar=GrammarRequest("json_schema", _SCHEMA),
    )
    if device == "cpu":
        return [
            WarmupCase("prefill + decode", 32, greedy),
            WarmupCase("decode batch 2", 24, greedy, copies=2),
            json_case,
        ]
    batch_sizes = [2, 8, 32, 128]
    cases = [
        WarmupCase("prefill + decode", 32, greedy),
        WarmupCase("prefill over a cached prefix", 48, greedy),
    ]
    cases += [
        WarmupCase(f"decode batch {b}", 24, greedy, copies=min(b, max_running), prompt_offset=7) for b in batch_sizes
    ]
    cases += [
        WarmupCase("top-k / top-p", 16, SamplingParams(max_new_tokens=new, temperature=0.8, top_p=0.9, top_k=40)),
        WarmupCase("seeded sampling", 16, SamplingParams(max_new_tokens=new, temperature=1.0, seed=1)),
        WarmupCase(
            "penalties and logit bias",
            16,
            SamplingParams(
                max_new_tokens=new,
                frequency_penalty=0.5,
                presence_penalty=0.5,
                repetition_penalty=1.1,
                logit_bias={13: -1.0},
            ),
        ),  # fmt: skip
        WarmupCase("logprobs", 16, greedy, top_logprobs=5),
        WarmupCase(
            "JSON schema",
            16,
            SamplingParams(max_new_tokens=2 * new, temperature=0.0),
            grammar=GrammarRequest("json_schema", _SCHEMA),
        ),  # fmt: skip
        WarmupCase(
            "regex",
            16,
            SamplingParams(max_new_tokens=new, temperature=0.0),
            grammar=GrammarRequest("regex", r"[a-z]{1,6} [0-9]{1,3}"),
        ),  # fmt: skip
    ]
    long = min(chunk + chunk // 2, context_length // 2) if chunk else min(1024, context_length // 2)
    if long > 64:
        cases.append(WarmupCase("long prompt (chunked prefill)", long, greedy, prompt_offset=3))
    return cases


def _prompt(tm, tokens: int, offset: int) -> list[int]:
    unit = tm.tokenizer.encode(_TEXT, add_special_tokens=False)
    ids = (unit * (tokens // max(1, len(unit)) + 2))[offset : offset + tokens]
    return ids


async def _run_case(tm, case: WarmupCase, index: int, replicas: int = 1) -> None:
    """One case; under data parallelism once on every replica, at the same time."""
    await asyncio.gather(*(_run_case_on(tm, case, index, r if replicas > 1 else -1) for r in range(replicas)))


async def _run_case_on(tm, case: WarmupCase, index: int, replica: int) -> None:
    ids = _prompt(tm, case.prompt_tokens, case.prompt_offset)
    images = ()
    if case.image:
        from PIL import Image

        gradient = Image.linear_gradient("L").convert("RGB").resize((64, 48))
        ids, images = tm.images.expand(ids[:4] + [tm.images.image_token_id] + ids[4:], [gradient])

    async def one(copy: int) -> None:
        rid = f"{WARMUP_RID_PREFIX}{index}-{copy}" if replica < 0 else f"{WARMUP_RID_PREFIX}{index}-r{replica}-{copy}"
        prompt = ids if copy == 0 else ids[:-1] + [ids[-1] + copy]  # distinct last tokens: one batch, not one cache hit
        async for _ in tm.generate(
            prompt,
            case.sampling,
            rid=rid,
            return_logprob=case.top_logprobs > 0,
            top_logprobs=case.top_logprobs,
            grammar=case.grammar,
            lora=case.lora,
            images=images,
            replica=replica,
        ):
            pass

    await asyncio.gather(*(one(c) for c in range(case.copies)))


async def warm_up(tm, cases: list[WarmupCase], timeout: float = 600.0, replicas: int = 1) -> float:
    """Run the cases one after the other; returns the seconds taken. A failing case is logged and skipped: the
    warm-up never keeps a server that can serve from turning ready."""
    from tqdm import tqdm

    t0 = time.monotonic()
    logger.info("warming up: %d cases (--skip-warmup to start without)", len(cases))
    timings = []
    quiet = not logger.isEnabledFor(logging.INFO)  # an Engine in a program that keeps our INFO logs off
    with tqdm(total=len(cases), desc="warm-up", file=sys.stderr, leave=True, mininterval=0, disable=quiet) as bar:
        for i, case in enumerate(cases):
            bar.set_postfix_str(case.name)
            start = time.monotonic()
            try:
                await asyncio.wait_for(_run_case(tm, case, i, replicas), timeout=max(1.0, timeout - (start - t0)))
            except Exception as exc:  # noqa: BLE001 - reported, then the next case
                logger.warning("warm-up case %r failed: %s", case.name, exc)
            timings.append(f"{case.name} {time.monotonic() - start:.2f} s")
            bar.update(1)
    total = time.monotonic() - t0
    logger.info("warm-up done in %.1f s: %s", total, "; ".join(timings))
    return total


async def warm_up_server(config, tm, runner_info: dict) -> None:
    """The warm-up of a started server or Engine: its configuration's cases, then `health.warming` cleared (even when
    a case fails or the warm-up is cancelled)."""
    settings = config.settings
    cases = warmup_cases(
        settings.device, runner_info["context_length"], settings.chunked_prefill_size, settings.max_running_requests
    )
    if tm.lora.names:  # the adapters' kernels: a batch of an adapter and the base model
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        cases.append(WarmupCase("LoRA adapter", 24, greedy, copies=2, prompt_offset=5, lora=tm.lora.names[0]))
    if tm.images is not None:  # the vision tower, and a prefill that splices its features
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        cases.append(WarmupCase("image", 16, greedy, copies=2, prompt_offset=7, image=True))
    try:
        await warm_up(tm, cases, replicas=config.args.dp_size)
    finally:
        tm.health.warming = False
