"""Tests for incremental detokenization, stop strings, and the Detokenizer process."""

from __future__ import annotations

import multiprocessing as mp
import random
import shutil
import tempfile

import pytest
import zmq

from gramserve.config import ServerArgs
from gramserve.detokenizer.incremental import IncrementalDecoder, StopStringFilter
from gramserve.detokenizer.process import DetokenizerManager, run_detokenizer_process
from gramserve.ipc import DETOKENIZER_IN, TOKENIZER_MANAGER_IN, pull_socket, push_socket
from gramserve.messages import BatchTextOut, BatchTokenOut, ControlResp, FinishReason, TokenLogprob
from gramserve.server.settings import in_process_config

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! This is plain ASCII text with numbers 12345 and symbols #$%&.",
    "Café crème brûlée, naïve façade, Ångström, Œuvre, ß, déjà vu.",
    "中文分词测试：今天天气很好，我们去公园散步吧。日本語のテキストも混ぜる。한국어 문장입니다.",
    "Emoji: 😀🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 and 🧑‍💻 coder.",
    "Mixed: αβγ δ — “quotes” … Привет мир! مرحبا ∑∫√∞ ≤≥ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done.",
    "def f(x):\n\tif x > 0:\n        return {'a': [1, 2]}\n\n\n    # comment   trailing   \n\r\n  pass\n",
    "   leading spaces, double  spaces,\ttabs\t\tand a trailing newline\n",
]


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer


def random_chunks(ids: list[int], rng: random.Random, max_size: int = 5) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_size)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def stream(tok, chunks: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """Feed chunks to a decoder; the last call has finish=True. Returns the deltas."""
    dec = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    deltas = [dec.decode(c) for c in chunks[:-1]]
    deltas.append(dec.decode(chunks[-1], finish=True))
    return deltas


def stream_filter(flt: StopStringFilter, pieces: list[str]) -> list[str]:
    """Push text pieces through a stop filter, flushing at the end; returns all outputs (flush last)."""
    outs = [flt.push(p) for p in pieces]
    outs.append(flt.flush())
    return outs


# ---------------------------------------------------------------- IncrementalDecoder


def test_texts_split_characters_over_tokens(tok):
    # The test corpus must actually exercise multi-byte characters split over byte-level tokens.
    split = [t for t in TEXTS if any(FFFD in tok.decode([i]) for i in tok.encode(t))]
    assert len(split) >= 3


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    dec = IncrementalDecoder(tok)
    emitted = ""
    for k, i in enumerate(ids, 1):
        delta = dec.decode([i], finish=k == len(ids))
        assert FFFD not in delta
        emitted += delta
        full = tok.decode(ids[:k])
        assert full.startswith(emitted)
        if FFFD not in full:
            assert emitted == full  # nothing held back once the text is complete
    assert emitted == text


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks(tok, text):
    ids = tok.encode(text)
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        deltas = stream(tok, random_chunks(ids, rng))
        assert all(FFFD not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids)


def test_all_texts_concatenated_long_stream_window_stays_small(tok):
    text = "\n".join(TEXTS * 5)
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    out, max_window = "", 0
    for i in ids:
        out += dec.decode([i])
        max_window = max(max_window, len(dec.ids) - dec.prefix_offset)
    out += dec.decode([], finish=True)
    assert out == text
    assert len(ids) > 500
    assert max_window <= 8  # O(1) work per step, independent of output length


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = [1] + tok.encode("Hi 😀") + [2, 1] + tok.encode("日本") + [2, 0]
    deltas = stream(tok, [[i] for i in ids], skip_special_tokens=skip)
    assert all(FFFD not in d for d in deltas)
    out = "".join(deltas)
    assert out == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in out) is (not skip)
    if skip:
        assert out == "Hi 😀日本"


def test_incomplete_char_held_then_flushed_at_finish(tok):
    ids = tok.encode("ok 😀")
    # Find a point where the text so far ends in the middle of the emoji.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    dec = IncrementalDecoder(tok)
    mid = dec.decode(ids[:cut])
    assert mid in ("ok", "ok ")  # the complete part only
    # Stream ends here: the dangling bytes are genuinely invalid and come out as U+FFFD.
    tail = dec.decode([], finish=True)
    assert (mid + tail) == tok.decode(ids[:cut])
    assert tail.endswith(FFFD)


def test_random_token_ids_match_full_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            deltas = stream(tok, random_chunks(ids, rng, 3), skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------- StopStringFilter


def test_stop_filter_single():
    flt = StopStringFilter(["STOP"])
    outs = stream_filter(flt, list("Hello world. STOP here"))
    assert "".join(outs) == "Hello world. "
    assert flt.matched == "STOP"
    assert flt.push("more") == "" and flt.flush() == ""


def test_stop_filter_multiple_first_occurrence_wins():
    text = "one END two\n\nthree"
    for stops in (["\n\n", "END"], ["END", "\n\n"]):
        flt = StopStringFilter(stops)
        assert "".join(stream_filter(flt, [text])) == "one "
        assert flt.matched == "END"
    # The match that completes first wins, so the result does not depend on chunking.
    rng = random.Random(1)
    for _ in range(50):
        flt = StopStringFilter(["xyz", "y", "abcd", "bc"])
        pieces, s = [], "..abcdxyz"
        while s:
            n = rng.randint(1, 4)
            pieces.append(s[:n])
            s = s[n:]
        assert "".join(stream_filter(flt, pieces)) == "..a"
        assert flt.matched == "bc"


def test_stop_filter_hold_back_then_release():
    flt = StopStringFilter(["</answer>"])
    assert flt.push("a <") == "a "
    assert flt.held == "<"
    assert flt.push("/ans") == ""
    assert flt.held == "</ans"
    assert flt.push("wer") == ""
    assert flt.push("s> b") == "</answers> b"  # turned out not to be the stop string
    assert flt.held == ""
    assert flt.push(" </") == " "
    assert flt.flush() == "</"  # flushed at finish
    assert flt.matched is None


def test_stop_filter_overlapping_prefix_release():
    # "aab": after "aa" the held suffix must restart correctly when the next char is "a".
    flt = StopStringFilter(["aab"])
    outs = stream_filter(flt, list("xaaaab!"))
    assert "".join(outs) == "xaa"
    assert flt.matched == "aab"


def test_stop_filter_at_start_and_no_stops():
    flt = StopStringFilter(["Hi"])
    assert "".join(stream_filter(flt, ["H", "i there"])) == ""
    assert flt.matched == "Hi"
    flt = StopStringFilter(["", ""])  # empty stop strings are ignored
    assert flt.push("text") == "text" and flt.matched is None


# ---------------------------------------------------------------- decoder + filter with real tokens


def _run_with_stops(tok, ids_chunks, stops):
    dec, flt = IncrementalDecoder(tok), StopStringFilter(stops)
    outs = []
    for k, c in enumerate(ids_chunks):
        outs.append(flt.push(dec.decode(c, finish=k == len(ids_chunks) - 1)))
        if flt.matched:
            return outs, flt.matched
    outs.append(flt.flush())
    return outs, flt.matched


STOP_CASES = [
    # (text, stops, expected output, expected match)
    ("The answer is 42. Done here.", ["s 4"], "The answer i", "s 4"),
    ("Café au lait 😀🎉 and more", ["😀🎉"], "Café au lait ", "😀🎉"),
    ("Line one\n\nLine two", ["\n\n", "Line two"], "Line one", "\n\n"),
    ("<|user|> hello", ["<|user|>"], "", "<|user|>"),
    ("no stop in here 中文", ["中文分", "zzz"], "no stop in here 中文", None),
    ("print(x)\n```\nafter", ["```"], "print(x)\n", "```"),
]


@pytest.mark.parametrize("text,stops,expected,match", STOP_CASES)
def test_stop_strings_over_tokens(tok, text, stops, expected, match):
    ids = tok.encode(text)
    rng = random.Random(7)
    chunkings = [[[i] for i in ids]] + [random_chunks(ids, rng, 4) for _ in range(10)]
    for chunks in chunkings:
        outs, matched = _run_with_stops(tok, chunks, stops)
        assert matched == match
        assert "".join(outs) == expected
        emitted = ""
        for o in outs:
            assert FFFD not in o
            emitted += o
            assert expected.startswith(emitted)  # no part of a stop string ever leaks


def test_stop_string_spans_tokens(tok):
    ids = tok.encode("The answer is 42. Done here.")
    pieces = [tok.decode([i]) for i in ids]
    assert "s 4" not in pieces and not any("s 4" in p for p in pieces)


# ---------------------------------------------------------------- DetokenizerManager


def token_out(items: list[dict]) -> BatchTokenOut:
    """Build a BatchTokenOut from per-request dicts (rid, ids, and optional fields)."""
    return BatchTokenOut(
        rids=[it["rid"] for it in items],
        new_token_ids=[it.get("ids", []) for it in items],
        finished=[it.get("finished") for it in items],
        prompt_tokens=[it.get("prompt", 5) for it in items],
        completion_tokens=[it.get("completion", 0) for it in items],
        cached_tokens=[it.get("cached", 0) for it in items],
        logprobs=[it.get("logprobs") for it in items],
        stop_strs=[tuple(it.get("stop", ())) for it in items],
        skip_special_tokens=[it.get("skip", True) for it in items],
    )


def entry(out: BatchTextOut, rid: str) -> dict:
    i = out.rids.index(rid)
    return {
        "delta": out.text_deltas[i],
        "ids": out.new_token_ids[i],
        "finished": out.finished[i],
        "prompt": out.prompt_tokens[i],
        "completion": out.completion_tokens[i],
        "cached": out.cached_tokens[i],
        "logprobs": out.logprobs[i],
    }


def test_manager_interleaved_streams(tok):
    mgr = DetokenizerManager(tok)
    ta, tb = TEXTS[3], TEXTS[2]
    ida, idb = tok.encode(ta), tok.encode(tb) + [2]
    texts = {"a": "", "b": ""}
    n = max(len(ida), len(idb))
    for k in range(n):
        items = []
        if k < len(ida):
            lp = [TokenLogprob(ida[k], -0.5, [(ida[k], -0.5)])]
            fin = FinishReason("length") if k == len(ida) - 1 else None
            items.append(
                {"rid": "a", "ids": [ida[k]], "finished": fin, "completion": k + 1, "cached": 3, "logprobs": lp}
            )
        if k < len(idb):
            fin = FinishReason("stop", matched=2) if k == len(idb) - 1 else None
            items.append({"rid": "b", "ids": [idb[k]], "finished": fin, "completion": k + 1, "prompt": 9})
        out = mgr.handle_batch(token_out(items))
        assert out is not None and len(out.rids) == len(items)
        for it in items:
            e = entry(out, it["rid"])
            assert FFFD not in e["delta"]
            assert e["ids"] == it["ids"] and e["completion"] == it["completion"]
            assert e["prompt"] == it.get("prompt", 5) and e["cached"] == it.get("cached", 0)
            assert e["logprobs"] == it.get("logprobs")
            assert e["finished"] == it["finished"]
            texts[it["rid"]] += e["delta"]
    assert texts == {"a": ta, "b": tb}
    assert mgr.states == {} and mgr.finished_early == set()


def test_manager_stop_string_before_scheduler_finishes(tok):
    mgr = DetokenizerManager(tok)
    ids = tok.encode("Sure! Here you go: ANSWER=7 END and then more text afterwards")
    text, finishes, k = "", [], 0
    while True:
        out = mgr.handle_batch(token_out([{"rid": "r", "ids": ids[k : k + 2], "stop": ["END", "never"]}]))
        k += 2
        assert out is not None
        e = entry(out, "r")
        text += e["delta"]
        assert "Sure! Here you go: ANSWER=7 ".startswith(text)
        if e["finished"] is not None:
            finishes.append(e["finished"])
            break
    assert text == "Sure! Here you go: ANSWER=7 "
    assert finishes == [FinishReason(type="stop", matched="END")]
    # The scheduler keeps sending tokens for a while: nothing more is reported for this rid.
    assert mgr.handle_batch(token_out([{"rid": "r", "ids": ids[k : k + 3], "stop": ["END"]}])) is None
    other = mgr.handle_batch(
        token_out([{"rid": "r", "ids": ids[k + 3 : k + 4]}, {"rid": "x", "ids": tok.encode("hi")}])
    )
    assert other is not None and other.rids == ["x"] and other.text_deltas == ["hi"]
    # Its own finish arrives: state dropped, no second finish sent.
    assert (
        mgr.handle_batch(token_out([{"rid": "r", "ids": [], "finished": FinishReason("stop", matched="END")}])) is None
    )
    assert "r" not in mgr.states and mgr.finished_early == set()


def test_manager_stop_string_overrides_scheduler_reason(tok):
    mgr = DetokenizerManager(tok)
    ids = tok.encode("abc STOP def")
    out = mgr.handle_batch(token_out([{"rid": "r", "ids": ids, "stop": ["STOP"], "finished": FinishReason("length")}]))
    assert entry(out, "r")["delta"] == "abc "
    assert entry(out, "r")["finished"] == FinishReason(type="stop", matched="STOP")
    assert mgr.states == {} and mgr.finished_early == set()


def test_manager_finish_flushes_held_prefix(tok):
    mgr = DetokenizerManager(tok)
    ids = tok.encode("value </")
    out1 = mgr.handle_batch(token_out([{"rid": "r", "ids": ids, "stop": ["</stop>"]}]))
    assert entry(out1, "r")["delta"] == "value "
    out2 = mgr.handle_batch(token_out([{"rid": "r", "ids": [], "finished": FinishReason("length")}]))
    assert entry(out2, "r") == {
        "delta": "</",
        "ids": [],
        "finished": FinishReason("length"),
        "prompt": 5,
        "completion": 0,
        "cached": 0,
        "logprobs": None,
    }
    assert mgr.states == {}


def test_manager_abort_passthrough(tok):
    mgr = DetokenizerManager(tok)
    ids = tok.encode("partial answer 😀")
    out = mgr.handle_batch(token_out([{"rid": "a", "ids": ids[:3]}]))
    assert entry(out, "a")["finished"] is None
    abort = FinishReason(type="abort", message="client disconnected")
    out = mgr.handle_batch(
        token_out(
            [
                {"rid": "a", "ids": [], "finished": abort},
                {"rid": "new", "ids": [], "finished": FinishReason("abort", message="queue full")},
            ]
        )
    )
    assert entry(out, "a")["finished"] == abort and entry(out, "a")["finished"].message == "client disconnected"
    assert entry(out, "new") == {
        "delta": "",
        "ids": [],
        "finished": FinishReason("abort", message="queue full"),
        "prompt": 5,
        "completion": 0,
        "cached": 0,
        "logprobs": None,
    }
    assert mgr.states == {}


def test_manager_skip_special_tokens_per_request(tok):
    mgr = DetokenizerManager(tok)
    ids = tok.encode("x") + [2] + tok.encode("y") + [2]
    out = mgr.handle_batch(
        token_out(
            [
                {"rid": "skip", "ids": ids, "finished": FinishReason("stop", matched=2)},
                {"rid": "keep", "ids": ids, "skip": False, "finished": FinishReason("stop", matched=2)},
            ]
        )
    )
    assert entry(out, "skip")["delta"] == "xy"
    # Special tokens inside the answer are kept; the EOS that ended it is not part of the text (as in SGLang).
    assert entry(out, "keep")["delta"] == "x<|im_end|>y"


def test_manager_abort_batch_after_error(tok):
    mgr = DetokenizerManager(tok)
    mgr.handle_batch(token_out([{"rid": "a", "ids": tok.encode("hello")}]))
    batch = token_out([{"rid": "a", "ids": [1]}])
    out = mgr.abort_batch(batch, RuntimeError("boom"))
    assert out.rids == ["a"] and out.finished[0].type == "abort" and "boom" in out.finished[0].message
    assert mgr.states == {}
    # Later tokens are dropped until the scheduler's own finish arrives.
    assert mgr.handle_batch(token_out([{"rid": "a", "ids": [5]}])) is None
    assert mgr.handle_batch(token_out([{"rid": "a", "ids": [], "finished": FinishReason("abort")}])) is None
    assert mgr.finished_early == set()


# ---------------------------------------------------------------- the real process over ZeroMQ


@pytest.fixture(scope="module", autouse=True)
def detok_process(request):
    """The real Detokenizer process, started when the module starts so its spawn overlaps the other tests."""
    if not any(item.name == "test_detokenizer_process_end_to_end" for item in request.session.items):
        yield None
        return
    from gramserve.model.loader import default_tokenizer_dir

    ipc_dir = tempfile.mkdtemp(prefix="gs-detok-")
    args = in_process_config(
        ServerArgs(log_level="warning", device="cpu"), ipc_dir=ipc_dir, tokenizer_dir=default_tokenizer_dir()
    )
    ctx = zmq.Context()
    out_sock = pull_socket(ctx, args.ipc_path(TOKENIZER_MANAGER_IN))
    out_sock.setsockopt(zmq.RCVTIMEO, 20000)
    mpctx = mp.get_context("spawn")
    reader, writer = mpctx.Pipe(duplex=False)
    proc = mpctx.Process(target=run_detokenizer_process, args=(args, writer), daemon=True)
    proc.start()
    try:
        yield args, ctx, out_sock, reader, proc
    finally:
        proc.kill()
        proc.join(10)
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_detokenizer_process_end_to_end(tok, detok_process):
    args, ctx, out_sock, reader, proc = detok_process
    assert reader.poll(60) and reader.recv() == "ready"
    in_sock = push_socket(ctx, args.ipc_path(DETOKENIZER_IN))
    ids = tok.encode("Bonjour 😀!")
    in_sock.send_pyobj(token_out([{"rid": "r", "ids": ids[:2]}]))
    in_sock.send_pyobj(ControlResp(qid="q1", payload={"x": 1}))
    # A malformed batch must be logged and answered with an abort, not kill the loop.
    bad = token_out([{"rid": "bad", "ids": [5]}])
    bad.stop_strs = [None]
    in_sock.send_pyobj(bad)
    in_sock.send_pyobj(token_out([{"rid": "r", "ids": ids[2:], "finished": FinishReason("length")}]))

    first = out_sock.recv_pyobj()
    assert isinstance(first, BatchTextOut) and first.rids == ["r"]
    assert out_sock.recv_pyobj() == ControlResp(qid="q1", payload={"x": 1})
    err = out_sock.recv_pyobj()
    assert err.rids == ["bad"] and err.finished[0].type == "abort"
    last = out_sock.recv_pyobj()
    assert last.rids == ["r"] and last.finished == [FinishReason("length")]
    assert first.text_deltas[0] + last.text_deltas[0] == "Bonjour 😀!"
    assert proc.is_alive()


def test_a_kept_stop_string_ends_the_text():
    """keep (include_stop_str_in_output / no_stop_trim): the text ends with the matched stop string, however the
    stream was chunked, and nothing after it."""
    for pieces in (["abcSTOPdef"], ["abcS", "TO", "Pdef"], list("abcSTOPdef")):
        flt = StopStringFilter(["STOP"], keep=True)
        out = "".join(flt.push(p) for p in pieces) + flt.flush()
        assert out == "abcSTOP" and flt.matched == "STOP", pieces
