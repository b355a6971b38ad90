"""The detokenizer's output pacing (detokenizer/pacing.py): which outputs go to the main process at once and which
wait, with a clock the test sets; and through the real server, that paced streams still say what unpaced ones do."""

from __future__ import annotations

import asyncio

import pytest
from conftest import start_server

from gramserve.detokenizer.pacing import STREAM_CHUNKS_PER_S, OutputPacer
from gramserve.messages import BatchTextOut, FinishReason

STREAMS = 250  # requests in flight: an interval of 250 / 5,000 s = 50 ms, capped at the pacer's 40 ms below


def step(*items) -> BatchTextOut:
    """One scheduler step's outputs: (rid, token) or (rid, token, finish type)."""
    rows = [(i[0], f"t{i[1]}", [i[1]], FinishReason(i[2]) if len(i) > 2 else None) for i in items]
    n = len(rows)
    return BatchTextOut(
        rids=[r[0] for r in rows],
        text_deltas=[r[1] for r in rows],
        new_token_ids=[r[2] for r in rows],
        finished=[r[3] for r in rows],
        prompt_tokens=[5] * n,
        completion_tokens=[r[2][0] for r in rows],
        cached_tokens=[0] * n,
        logprobs=[None] * n,
        grammar_backends=[None] * n,
    )


def _textless(rid: str, token: int) -> BatchTextOut:
    out = step((rid, token))
    out.text_deltas[0] = ""
    return out


def sent(out: BatchTextOut | None) -> list[tuple[str, int]]:
    return [] if out is None else [(rid, ids[0]) for rid, ids in zip(out.rids, out.new_token_ids)]


def test_first_outputs_go_at_once_later_ones_wait_for_the_interval():
    pacer = OutputPacer(max_interval_s=0.040)
    assert pacer.interval(STREAMS) == 0.040 and pacer.interval(10) == pytest.approx(10 / STREAM_CHUNKS_PER_S)
    assert sent(pacer.push(step(("a", 1), ("b", 1)), STREAMS, now=0.000)) == [("a", 1), ("b", 1)]
    assert pacer.push(step(("a", 2), ("b", 2)), STREAMS, now=0.010) is None
    assert pacer.push(step(("a", 3)), STREAMS, now=0.020) is None
    assert pacer.next_due() == pytest.approx(0.040)
    assert pacer.take_due(now=0.039) is None
    out = pacer.take_due(now=0.040)
    assert sent(out) == [("a", 2), ("a", 3), ("b", 2)]  # each request's outputs in order
    assert out.text_deltas == ["t2", "t3", "t2"] and out.completion_tokens == [2, 3, 2]
    assert pacer.next_due() is None
    # The next outputs wait from the release on; held outputs that are due go out with the next push.
    assert pacer.push(step(("a", 4)), STREAMS, now=0.050) is None
    assert pacer.push(step(("b", 3)), STREAMS, now=0.079) is None
    assert sent(pacer.push(step(("b", 4)), STREAMS, now=0.081)) == [("a", 4), ("b", 3), ("b", 4)]
    assert pacer.next_due() is None and pacer.last_sent == {"a": 0.081, "b": 0.081}


def test_a_finish_goes_at_once_after_what_its_request_had_waiting():
    pacer = OutputPacer(max_interval_s=0.040)
    pacer.push(step(("a", 1), ("b", 1)), STREAMS, now=0.0)
    assert pacer.push(step(("a", 2), ("b", 2)), STREAMS, now=0.005) is None
    out = pacer.push(step(("a", 3, "stop"), ("b", 3)), STREAMS, now=0.010)
    assert sent(out) == [("a", 2), ("a", 3)]
    assert out.finished[0] is None and out.finished[1].type == "stop"
    assert "a" not in pacer.last_sent and "a" not in pacer.held
    assert sent(pacer.take_due(now=0.040)) == [("b", 2), ("b", 3)]
    # Outputs without text yet (part of a character, a possible stop string) do not start the interval.
    assert sent(pacer.push(_textless("d", 1), STREAMS, now=0.041)) == [("d", 1)]
    assert sent(pacer.push(_textless("d", 2), STREAMS, now=0.042)) == [("d", 2)]
    assert sent(pacer.push(step(("d", 3)), STREAMS, now=0.043)) == [("d", 3)]  # its first text: at once
    assert pacer.push(step(("d", 4)), STREAMS, now=0.044) is None
    # An aborted request's first and only output goes at once too.
    assert sent(pacer.push(step(("c", 9, "abort")), STREAMS, now=0.041)) == [("c", 9)]
    assert pacer.last_sent == {"b": 0.040, "d": 0.043}


def test_with_few_requests_in_flight_nothing_waits():
    pacer = OutputPacer(max_interval_s=0.050)
    streams = 4  # 0.8 ms: shorter than any decode step
    for t in range(1, 20):
        out = pacer.push(step(("a", t), ("b", t)), streams, now=t * 0.002)
        assert sent(out) == [("a", t), ("b", t)]
    assert pacer.next_due() is None


async def _stream(client, prompt: str) -> tuple[str, int]:
    stream = await client.completions.create(
        model="tiny_llama", prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    text, chunks = "", 0
    async for chunk in stream:
        text += chunk.choices[0].text
        chunks += 1
    return text, chunks


def test_paced_streams_carry_the_same_text_as_whole_answers(tmp_path):
    """48 streams at once on a server that paces them (an interval of 9.6 ms at 48 requests, about a decode step of
    this model here) against the same prompts answered whole, one at a time."""
    server = start_server(str(tmp_path), "--model-path", "tests/data/tiny_llama.json", "--load-format", "dummy")
    try:
        _compare(server.base_url)
    finally:
        server.stop()


def _compare(url: str) -> None:
    from openai import AsyncOpenAI, OpenAI

    prompts = [f"request {i}: say something about the number {i * 7}" for i in range(48)]
    client = OpenAI(base_url=url + "/v1", api_key="x")
    whole = dict(model="tiny_llama", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    expected = [client.completions.create(prompt=p, **whole).choices[0].text for p in prompts[:8]]

    async def run():
        streams = AsyncOpenAI(base_url=url + "/v1", api_key="x")
        return await asyncio.gather(*(_stream(streams, p) for p in prompts))

    results = asyncio.run(run())
    assert [text for text, _ in results[:8]] == expected
    assert all(len(text) > 0 for text, _ in results)
    assert all(chunks <= 41 for _, chunks in results)
