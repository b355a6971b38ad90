"""Continuous batching: many simultaneous streams finish with their own text, and the KV pool comes back whole."""

from __future__ import annotations

import asyncio

import httpx
from conftest import wait_pool_whole

TOPICS = ["cats", "the ocean", "trains", "music", "winter", "coffee", "robots", "gardens"]


def _prompts(n: int) -> list[str]:
    return [f"Write one sentence about {TOPICS[i % len(TOPICS)]} and the number {i}." for i in range(n)]


def test_32_concurrent_streams_match_sequential(make_async_client, client, model_name, base_url):
    prompts = _prompts(32)
    max_tokens = 24

    async_client = make_async_client()

    async def stream_one(prompt: str) -> tuple[str, str | None]:
        stream = await async_client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        return text, finish

    async def run_all():
        return await asyncio.gather(*(stream_one(p) for p in prompts))

    concurrent = asyncio.run(run_all())
    info = httpx.get(base_url + "/get_server_info").json()
    assert info["stats"]["forward_steps"] > 0
    assert info["sampling_backend"] == "torch" or info["runner"]["device"].startswith("cuda")  # flashinfer: CUDA only
    # Every `auto` reported as given and as resolved; what the launcher derived beside it.
    assert info["server_args"]["device"] == "auto" and info["server_args"]["max_running_requests"] is None
    settings = info["settings"]
    assert settings["device"] == info["runner"]["device"].split(":")[0]
    assert settings["sampling_backend"] == info["sampling_backend"]
    assert settings["attention_backend"] == info["runner"]["attention_backend"]
    assert settings["max_running_requests"] == info["kv_pool"]["max_running_requests"]
    assert info["launch"]["tool_call_parser"] and info["launch"]["vocab_size"] > 0

    for prompt, (text, finish) in zip(prompts, concurrent):
        assert finish in ("stop", "length")
        alone = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
        )
        assert text == alone.choices[0].message.content, prompt
        assert finish == alone.choices[0].finish_reason

    pool = wait_pool_whole(base_url)
    # Whole: every slot is free or held by the prefix cache (evictable), none by a request.
    assert pool["used_slots"] == 0, pool
    assert pool["free_slots"] + pool["evictable_slots"] == pool["total_slots"], pool


def test_batching_actually_overlaps(make_async_client, model_name, base_url):
    """Requests arriving while others decode join the running batch (fewer steps than sequential)."""
    before = httpx.get(base_url + "/get_server_info").json()["stats"]["forward_steps"]
    n, max_tokens = 8, 16

    async_client = make_async_client()

    async def one(i: int):
        return await async_client.completions.create(
            model=model_name, prompt=f"Item {i}:", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(n)))

    results = asyncio.run(run_all())
    assert all(r.usage.completion_tokens == max_tokens for r in results)
    steps = httpx.get(base_url + "/get_server_info").json()["stats"]["forward_steps"] - before
    assert steps < n * max_tokens / 2, f"{steps} forward steps for {n} requests: batching is not happening"
    wait_pool_whole(base_url)
