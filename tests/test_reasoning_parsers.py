"""Reasoning parsers (gramserve.parsers.reasoning): one-shot split into (reasoning, content), and
streaming that equals it for every split of the text (two chunks at every point, one character at
a time, random chunkings). Both parts are stripped of surrounding whitespace, None when empty."""

from __future__ import annotations

import random

import pytest

from gramserve.parsers.reasoning import REASONING_PARSERS, get_reasoning_parser

# (parser, chat_template_kwargs, output, expected reasoning, expected content)
CASES = [
    (
        "deepseek-r1",
        None,
        "<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.",
        "The user wants 2+2.",
        "The answer is 4.",
    ),
    (
        "deepseek-r1",
        None,
        "The user wants 2+2.\n</think>\n\nThe answer is 4.",
        "The user wants 2+2.",
        "The answer is 4.",
    ),
    ("deepseek-r1", None, "Still thinking about a < b and </thi", "Still thinking about a < b and </thi", None),
    ("deepseek-r1", None, "<think>\ncut off mid-thought", "cut off mid-thought", None),
    ("deepseek-r1", None, "</think>Just the answer.", None, "Just the answer."),
    ("deepseek-r1", None, "", None, None),
    ("deepseek-r1", {"enable_thinking": False}, "no </think> honoring here", "no", "honoring here"),
    ("qwen3", None, "<think>\nLet me think: 😀 é.\n</think>\n\nHello!", "Let me think: 😀 é.", "Hello!"),
    ("qwen3", None, "Hello! No thinking today. </think> stays", None, "Hello! No thinking today. </think> stays"),
    ("qwen3", None, "  <think>truncated", "truncated", None),
    ("qwen3", None, "<thinking is not a tag", None, "<thinking is not a tag"),
    ("qwen3", None, "<thi", None, "<thi"),
    ("qwen3", {"enable_thinking": False}, "<think>\n\n</think>\n\nHello!", None, "<think>\n\n</think>\n\nHello!"),
    ("qwen3", {"enable_thinking": True}, "<think>a</think>b", "a", "b"),
    ("qwen3-thinking", None, "Reasoning here.\n</think>\n\nAnswer <b>.", "Reasoning here.", "Answer <b>."),
    ("qwen3-thinking", None, "<think>Reasoning</think>Answer", "Reasoning", "Answer"),
    ("qwen3-thinking", None, "never finished", "never finished", None),
    ("qwen3-thinking", {"enable_thinking": False}, "Answer only.", None, "Answer only."),
]


def splits(text: str):
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_parse(name, kwargs, text, reasoning, content):
    assert get_reasoning_parser(name)(kwargs).parse(text) == (reasoning, content)


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_streaming_every_split(name, kwargs, text, reasoning, content):
    for chunks in splits(text):
        p = get_reasoning_parser(name)(kwargs)
        r = c = ""
        for part in [p.feed(x) for x in chunks] + [p.finish()]:
            r += part[0]
            c += part[1]
        assert (r, c) == (reasoning or "", content or ""), chunks


def test_partial_end_marker_held_back():
    p = get_reasoning_parser("deepseek-r1")()
    assert p.feed("a </th") == ("a", "")
    assert p.in_reasoning
    assert p.feed("ink>b") == ("", "b")
    assert not p.in_reasoning
    assert p.finish() == ("", "")


def test_starts_in_reasoning():
    assert get_reasoning_parser("deepseek-r1")().starts_in_reasoning
    assert get_reasoning_parser("qwen3-thinking")().starts_in_reasoning
    assert not get_reasoning_parser("qwen3-thinking")({"enable_thinking": False}).starts_in_reasoning
    assert not get_reasoning_parser("qwen3")().starts_in_reasoning
    q = get_reasoning_parser("qwen3")()
    q.feed("<think>")
    assert q.in_reasoning


def test_registry():
    assert set(REASONING_PARSERS) >= {"deepseek-r1", "qwen3", "qwen3-thinking"}
    assert get_reasoning_parser("deepseek_r1").name == "deepseek-r1"
    for cls in REASONING_PARSERS.values():
        assert (cls.start_marker, cls.end_marker) == ("<think>", "</think>")
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
