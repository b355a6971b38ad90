"""The openai SDK's structured-output helpers against a running gramserve, on short everyday prompts.

What a user of `client.chat.completions.parse` / `.stream` sees with the default model and default sampling (the
SDK sends no temperature, so the server's 1.0 applies; no max_tokens unless ``--max-tokens``): per helper, how many
calls succeed (the SDK returns a parsed object or parsed tool calls, no exception), and why the others fail
(``LengthFinishReasonError``: the answer ran to max_tokens; a pydantic error: the output did not parse, which
constrained decoding must make impossible). Helpers:

* ``parse`` with a pydantic ``response_format`` (three models: a city, an event, a contact);
* ``parse`` with strict pydantic function tools, ``tool_choice`` ``auto`` and ``required`` (an ``auto`` answer in
  text counts as success: the model may answer without a call);
* ``stream`` with a pydantic ``response_format`` and with a required strict tool (``get_final_completion``).

Example (server already running, e.g. ``make serve``)::

    python benchmarks/bench_sdk_helpers.py --base-url http://127.0.0.1:30000 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from typing import Literal

import openai
from openai import AsyncOpenAI, pydantic_function_tool
from pydantic import BaseModel


class City(BaseModel):
    name: str
    country: str
    population: int


class Event(BaseModel):
    title: str
    date: str
    attendees: list[str]


class Contact(BaseModel):
    name: str
    email: str
    phone: str | None


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


class AddEvent(BaseModel):
    """Add an event to the user's calendar."""

    title: str
    day: str


FORMAT_PROMPTS = {
    City: ["The largest city in France, as JSON.", "Tell me about Tokyo.", "Give me a city in Brazil."],
    Event: ["Lunch with Bob on Friday.", "Plan a birthday party for Ann.", "Team meeting next Monday with Li and Sam."],
    Contact: ["My name is Ada Lovelace, ada@example.com.", "Call Tom at 555-0100.", "Add Maria to my contacts."],
}
TOOL_PROMPTS = [
    "What's the weather in Paris?",
    "Is it raining in London right now?",
    "Add lunch with Bob on Friday to my calendar.",
    "Do I need an umbrella in Berlin today?",
]
TOOLS = [pydantic_function_tool(GetWeather), pydantic_function_tool(AddEvent)]


async def call(kind: str, coro) -> tuple[str, str]:
    """(kind, outcome): "ok" or the name of the exception the SDK raised."""
    try:
        await coro
        return kind, "ok"
    except openai.LengthFinishReasonError:
        return kind, "LengthFinishReasonError"
    except Exception as exc:  # noqa: BLE001 - every other failure is reported by type
        return kind, f"{type(exc).__name__}: {str(exc)[:120]}"


async def parse_format(client, model, fmt, prompt, max_tokens):
    r = await client.chat.completions.parse(
        model=model, response_format=fmt, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
    )
    if r.choices[0].message.parsed is None:
        raise ValueError(f"nothing parsed (finish_reason {r.choices[0].finish_reason})")


async def parse_tools(client, model, prompt, choice, max_tokens):
    r = await client.chat.completions.parse(
        model=model,
        tools=TOOLS,
        tool_choice=choice,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
    )
    msg = r.choices[0].message
    calls = msg.tool_calls or []
    if choice == "required" and not calls:
        raise ValueError("no tool call")
    if not calls and not msg.content:
        raise ValueError("neither a call nor content")
    for c in calls:
        if c.function.parsed_arguments is None:
            raise ValueError("arguments not parsed")


async def stream_format(client, model, fmt, prompt, max_tokens):
    async with client.chat.completions.stream(
        model=model, response_format=fmt, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
    ) as s:
        async for _ in s:
            pass
        final = await s.get_final_completion()
    if final.choices[0].message.parsed is None:
        raise ValueError("nothing parsed")


async def stream_tools(client, model, prompt, max_tokens):
    async with client.chat.completions.stream(
        model=model,
        tools=TOOLS,
        tool_choice="required",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
    ) as s:
        async for _ in s:
            pass
        final = await s.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    if not calls or any(c.function.parsed_arguments is None for c in calls):
        raise ValueError("no parsed call")


async def run(args) -> list[tuple[str, str]]:
    client = AsyncOpenAI(
        base_url=args.base_url.rstrip("/") + "/v1", api_key="none", timeout=args.timeout, max_retries=0
    )
    model = (await client.models.list()).data[0].id
    jobs = []
    for _ in range(args.repeats):
        for fmt, prompts in FORMAT_PROMPTS.items():
            for p in prompts:
                jobs.append(call(f"parse {fmt.__name__}", parse_format(client, model, fmt, p, args.max_tokens)))
            jobs.append(call("stream response_format", stream_format(client, model, fmt, prompts[0], args.max_tokens)))
        for p in TOOL_PROMPTS:
            for choice in ("auto", "required"):
                jobs.append(call(f"parse tools {choice}", parse_tools(client, model, p, choice, args.max_tokens)))
            jobs.append(call("stream tools required", stream_tools(client, model, p, args.max_tokens)))
    sem = asyncio.Semaphore(args.concurrency)

    async def bounded(job):
        async with sem:
            return await job

    return await asyncio.gather(*(bounded(j) for j in jobs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None, help="default: none sent (the server's default)")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args()
    t0 = time.monotonic()
    results = asyncio.run(run(args))
    by: dict[str, Counter] = defaultdict(Counter)
    for kind, outcome in results:
        by[kind][outcome] += 1
    print("| helper | calls | ok | failures |")
    print("|---|---:|---:|---|")
    for kind in sorted(by):
        c = by[kind]
        fails = ", ".join(f"{k} x{v}" for k, v in c.items() if k != "ok") or "-"
        print(f"| {kind} | {sum(c.values())} | {c['ok']} | {fails} |")
    ok = sum(o == "ok" for _, o in results)
    print(f"\n{ok} of {len(results)} calls succeeded in {time.monotonic() - t0:.0f} s")
    print("command: python " + " ".join(sys.argv))
    print(json.dumps({k: dict(v) for k, v in by.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
