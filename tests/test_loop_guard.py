"""The loop guard (grammar/loop_guard.py): exact loops in a JSON output are broken by banning the token that would
continue them, remembered bans keep the loop from starting over, and the mask never loses its last allowed token.

LoopGuard alone, then GrammarService with llguidance and the default tokenizer (no model); the HTTP test with the
default model is in test_structured_outputs.py.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import torch

from gramserve.grammar.backends import GrammarOptions
from gramserve.grammar.json_shape import ITEM_CHARS, ITEM_SPAN, STALL_SPAN, JsonShape, JsonTokens
from gramserve.grammar.loop_guard import MAX_DIGIT_RUN, MIN_SPAN, DigitTokens, LoopGuard
from gramserve.grammar.service import GrammarService, ban_tokens
from gramserve.grammar.unique_arrays import UniqueArrays, unique_arrays
from gramserve.messages import GrammarCompileReq, GrammarRequest, GrammarStepReq
from gramserve.sampling.bitmask import allocate_bitmask
from tests.test_grammar_compile_cache import EOS, collect


def first_ban(tokens: list[int]) -> tuple[int, set[int]] | None:
    guard = LoopGuard()
    for i, t in enumerate(tokens):
        guard.accept(t)
        if banned := guard.banned():
            return i, banned
    return None


def guarded_service(tokenizer, bitmask) -> GrammarService:
    """A grammar service with the loop guard on, filling rows on the calling thread."""
    return GrammarService(
        tokenizer, len(tokenizer), [EOS], GrammarOptions(loop_guard=True), bitmask, fill_threads=0, compile_timeout_s=30
    )


def compile_schemas(svc: GrammarService, schemas: dict[str, dict]) -> None:
    """Compile one JSON schema per rid and wait until each has a matcher."""
    for rid, schema in schemas.items():
        svc.submit(GrammarCompileReq(rid, GrammarRequest("json_schema", json.dumps(schema))))
    assert all(r.error is None for r in collect(svc, set(schemas)).values())


def test_a_loop_is_banned_once_it_spans_min_span_tokens():
    assert first_ban([7] * 40) == (MIN_SPAN - 1, {7})  # one token over and over
    assert first_ban([1, 2, 3] * 20) == (15, {2})  # 16 tokens (5 periods and one token); next would be 2
    # a long period needs three whole periods: 3 * 12 tokens
    period = list(range(100, 112))
    assert first_ban(period * 5) == (35, {100})


def test_text_that_does_not_repeat_is_left_alone():
    rng = random.Random(0)
    assert first_ban([rng.randrange(1000) for _ in range(500)]) is None
    # counting up (item 1, item 2, ...) is not an exact loop
    assert first_ban([t for i in range(60) for t in (5, 6, 1000 + i)]) is None
    # a short repetition is fine
    assert first_ban([1, 2] * 7 + [9]) is None


def test_a_broken_loop_cannot_start_over():
    guard = LoopGuard()
    for t in [4, 5] * 8:  # loop: 4 5 4 5 ..., banned once it spans 16 tokens
        guard.accept(t)
    assert guard.banned() == {4}
    for t in [8, 9, 10, 4, 5, 4]:  # the model went elsewhere, then back into the loop
        guard.accept(t)
    assert guard.banned() == set()  # 4 5 4: the remembered context (5 4 5 4) is not complete yet
    guard.accept(5)
    assert guard.banned() == {4}  # ... now it is: the third repeat is banned at once


def test_ban_tokens_never_leaves_a_row_empty():
    row = torch.full((4,), -1, dtype=torch.int32)
    assert ban_tokens(row, {0, 31, 127}) == 1
    assert row.tolist() == [0x7FFFFFFE, -1, -1, 0x7FFFFFFF]
    only = torch.zeros(4, dtype=torch.int32)
    only[1] = 1 << 3  # token 35 is the only one allowed
    assert ban_tokens(only, {35}) == 0 and only[1] == 1 << 3
    assert ban_tokens(only, {36}) == 0  # not allowed anyway: nothing changes


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def test_the_service_bans_the_continuation_inside_a_json_string(tokenizer):
    """A string value that repeats one token: from MIN_SPAN repeats on, the mask no longer allows the repeat (the
    grammar would), and the step reply counts the ban. A regex request is left alone."""
    bitmask = allocate_bitmask(2, len(tokenizer))
    options = GrammarOptions(loop_guard=True)
    svc = GrammarService(tokenizer, len(tokenizer), [EOS], options, bitmask, fill_threads=0, compile_timeout_s=30.0)
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    try:
        svc.submit(GrammarCompileReq("j", GrammarRequest("json_schema", json.dumps(schema))))
        svc.submit(GrammarCompileReq("r", GrammarRequest("regex", "x(ab)*")))
        assert all(r.error is None for r in collect(svc, {"j", "r"}).values())
        ab = tokenizer.encode("ab", add_special_tokens=False)
        assert len(ab) == 1
        head = tokenizer.encode('{"s": "', add_special_tokens=False)
        x = tokenizer.encode("x", add_special_tokens=False)
        steps = [("j", t) for t in head] + [("r", t) for t in x]
        reply = svc.step(GrammarStepReq(0, steps, [("j", 0), ("r", 1)], []))
        bans = []
        for i in range(1, 3 * MIN_SPAN):
            reply = svc.step(GrammarStepReq(i, [("j", ab[0]), ("r", ab[0])], [("j", 0), ("r", 1)], []))
            bans.append(reply.loop_bans)
            assert allowed(bitmask, 1, ab[0])  # the regex keeps its repetitions
            assert allowed(bitmask, 0, ab[0]) == (i < MIN_SPAN), i
        # from STALL_SPAN tokens in the string on, the stalled-string rule counts too (only a closing token is left)
        assert [min(b, 1) for b in bans] == [0] * (MIN_SPAN - 1) + [1] * (2 * MIN_SPAN)
    finally:
        svc.close()


def test_a_run_of_digits_ends_past_max_digit_run(tokenizer):
    """Digit strings that never repeat exactly (a small model wandering "1212211122...") end once MAX_DIGIT_RUN
    digits stand in a row: no digit token is allowed next; any other token starts the count over."""
    digits = DigitTokens.of(tokenizer)
    one, two = tokenizer.convert_tokens_to_ids(["1", "2"])
    assert {one, two} <= digits.ids and len(digits.ids) >= 10
    guard = LoopGuard(digits)
    rng = random.Random(1)
    wander = [rng.choice([one, two]) for _ in range(MAX_DIGIT_RUN)]
    for t in wander[:-1]:
        guard.accept(t)
        assert not (guard.banned() & digits.ids)
    guard.accept(wander[-1])
    assert guard.banned() >= digits.ids
    guard.accept(tokenizer.convert_tokens_to_ids("-"))
    assert not (guard.banned() & digits.ids)


def test_the_service_ends_a_digit_string_unless_the_grammar_wants_digits(tokenizer):
    bitmask = allocate_bitmask(2, len(tokenizer))
    svc = guarded_service(tokenizer, bitmask)
    free = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    fixed = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[0-9]{40}$"}}, "required": ["s"]}
    try:
        svc.submit(GrammarCompileReq("free", GrammarRequest("json_schema", json.dumps(free))))
        svc.submit(GrammarCompileReq("fixed", GrammarRequest("json_schema", json.dumps(fixed))))
        assert all(r.error is None for r in collect(svc, {"free", "fixed"}).values())
        head = tokenizer.encode('{"s": "', add_special_tokens=False)
        rng = random.Random(2)  # digits that wander: no exact loop for the other half of the guard to catch
        wander = tokenizer.convert_tokens_to_ids([str(rng.randrange(10)) for _ in range(MAX_DIGIT_RUN + 4)])
        steps = [(rid, t) for rid in ("free", "fixed") for t in head]
        svc.step(GrammarStepReq(0, steps, [("free", 0), ("fixed", 1)], []))
        for i, t in enumerate(wander, start=1):
            svc.step(GrammarStepReq(i, [("free", t), ("fixed", t)], [("free", 0), ("fixed", 1)], []))
            assert allowed(bitmask, 0, t) == (i < MAX_DIGIT_RUN), i
            assert allowed(bitmask, 1, t)  # 40 digits or nothing: the grammar decides
    finally:
        svc.close()


def feed_text(guard: LoopGuard, tokenizer, text: str) -> list[int]:
    """Feed `text` token by token; the positions (in tokens) where the guard banned something."""
    hits = []
    for i, t in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        guard.accept(t)
        if guard.banned():
            hits.append(i)
    return hits


def test_a_counting_loop_is_banned(tokenizer):
    """Periods equal but for numbers that go up ("map49": {"map50": ..., items whose quantity goes up by one): the
    guard bans the token that continues the structure after the number."""
    digits = DigitTokens.of(tokenizer)
    maps = "".join(f'"map{i}": {{\n ' for i in range(40, 60))
    items = "".join(f'{{"name": "Alec", "price": {i}00.00, "quantity": {i}}},\n ' for i in range(10, 20))
    for text in (maps, items):
        guard = LoopGuard(digits)
        hits = feed_text(guard, tokenizer, text)
        assert hits, text[:40]
        banned = guard.banned() or set()
        assert not banned & digits.ids  # the numbers themselves are never what is banned
        assert LoopGuard().banned() == set() and not feed_text(LoopGuard(), tokenizer, text)  # no exact loop


def test_numbers_that_do_not_count_up_are_left_alone(tokenizer):
    digits = DigitTokens.of(tokenizer)
    rng = random.Random(3)
    points = "".join(f'{{"x": {rng.randrange(100)}.{rng.randrange(9)}, "y": {rng.randrange(99)}}}, ' for _ in range(30))
    years = ", ".join(str(y) for y in range(1990, 2030))  # counting up, but no word in the period
    scores = ", ".join(str(rng.randrange(100)) for _ in range(60))
    for text in (points, years, scores):
        assert not feed_text(LoopGuard(digits), tokenizer, text), text[:40]


def test_a_stalled_string_may_only_close(tokenizer):
    """Near-loops that never repeat exactly ("FleetAppServerClientFleetFleet...", a held-out CloudFormation output
    cut at max_tokens): once a JSON string's last STALL_SPAN tokens hold at most STALL_DISTINCT distinct ones, the
    next token must close it where the grammar allows that; a string of natural text, escaped quotes and a bounded
    pattern are left alone."""
    strings = JsonTokens.of(tokenizer, len(tokenizer))
    rng = random.Random(5)
    parts = ["Fleet", "App", "Server", "Client", "-", "nj", "LINUX", "_"]
    junk = "".join(rng.choice(parts) for _ in range(120))
    guard = LoopGuard(None, strings)
    tokens = tokenizer.encode('{"name": "' + junk, add_special_tokens=False)
    stalled = []
    for i, t in enumerate(tokens):
        guard.accept(t)
        stalled.append(guard.narrowing()[0] is strings.string_closers)
    first = stalled.index(True)
    assert STALL_SPAN <= first < STALL_SPAN + 8 and all(stalled[first:])
    guard.accept(tokenizer.encode('"', add_special_tokens=False)[0])  # closed: nothing to watch
    assert guard.narrowing() == (None, None)

    prose = (
        "Deploys the checkout service to the staging cluster every weekday morning, after the integration tests "
        'pass and the on-call engineer approves the change in the \\"release\\" channel; rollbacks are automatic '
        "when the error rate doubles within ten minutes of the rollout, and the team is paged."
    )
    guard = LoopGuard(None, strings)
    for t in tokenizer.encode('{"note": "' + prose, add_special_tokens=False):
        guard.accept(t)
        assert guard.narrowing() == (None, None)

    bitmask = allocate_bitmask(2, len(tokenizer))
    svc = guarded_service(tokenizer, bitmask)
    free = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1000}}, "required": ["s"]}
    quote = tokenizer.convert_tokens_to_ids('"')
    try:
        svc.submit(GrammarCompileReq("free", GrammarRequest("json_schema", json.dumps(free))))
        svc.submit(GrammarCompileReq("long", GrammarRequest("json_schema", json.dumps(long))))
        assert all(r.error is None for r in collect(svc, {"free", "long"}).values())
        tokens = tokenizer.encode('{"s": "' + junk, add_special_tokens=False)
        for i, t in enumerate(tokens):
            svc.step(GrammarStepReq(i, [("free", t), ("long", t)], [("free", 0), ("long", 1)], []))
        row = bitmask[0].numpy().view("uint32")
        assert allowed(bitmask, 0, quote) and not allowed(bitmask, 0, tokens[-1])
        assert all((int(row[t >> 5]) >> (t & 31)) & 1 == 0 or '"' in strings.texts[t] for t in range(len(tokenizer)))
        assert allowed(bitmask, 1, tokens[-1]) and not allowed(bitmask, 1, quote)  # 1,000 characters first
    finally:
        svc.close()


def shape_of(tokenizer, json_tokens: JsonTokens, text: str) -> list[bool]:
    """Feed `text` to a JsonShape token by token: after each token, is the innermost container stalled?"""
    shape = JsonShape(json_tokens)
    out = []
    for t in tokenizer.encode(text, add_special_tokens=False):
        shape.accept(t)
        out.append(shape.container_stalled())
    return out


def test_repeating_array_items_and_repeated_keys_stall_their_container(tokenizer):
    """Held-out outputs cut at max_tokens: the same tag object again and again with the newlines between items
    changing (no exact token loop), two strings in turn, a key twice in one map. Data that repeats (numbers, a few
    equal labels, records that differ) and escaped quotes are left alone."""
    json_tokens = JsonTokens.of(tokenizer, len(tokenizer))
    item = '{"Key": "1234567890", "Value": "1234567890"}'  # 41 characters without the spaces: 3 copies will do
    assert 3 * len(item.replace(" ", "")) >= ITEM_CHARS
    seps = [",\n", " ,\n", ",\n\n", ", "]
    tags = '{"Tags": [' + "".join(item + seps[i] for i in range(2)) + item
    stalled = shape_of(tokenizer, json_tokens, tags)
    assert not any(stalled[:-1]) and stalled[-1]  # from the closing brace of the third copy on
    assert not shape_of(tokenizer, json_tokens, tags + ",\n" + item[:12])[-1]  # inside an item: it decides
    short = "[" + ", ".join(['"EventCategories,"', '","'] * (ITEM_SPAN // 2))  # short items: ITEM_SPAN of them
    stalled = shape_of(tokenizer, json_tokens, short)
    assert stalled[-1] and not any(shape_of(tokenizer, json_tokens, short[: short.rindex(",")]))
    assert shape_of(tokenizer, json_tokens, '{"m": {"v1beta1": "a", "x": "b", "v1beta1": "c"')[-1]

    leave = [
        '{"n": [' + ", ".join(["0"] * 40) + "]",
        '{"l": [' + ", ".join(['"positive"'] * (ITEM_SPAN - 1)) + ', "neutral", "positive"',
        "[" + ", ".join('{"sku": "A-%d", "qty": %d}' % (1000 + i, i % 3) for i in range(30)),
        '{"s": "a \\" b", "t": ["x\\\\", "x\\"", "[", "]", "{", "}"',
    ]
    for text in leave:
        assert not any(shape_of(tokenizer, json_tokens, text)), text

    # a long output keeps only the text its open containers still need
    shape = JsonShape(json_tokens)
    records = "[" + ", ".join('{"id": %d, "note": "%s"}' % (i, "word " * (i % 50)) for i in range(1000)) + "]"
    for t in tokenizer.encode('{"a": ' + records + ', "b": "' + "long text " * 3000, add_special_tokens=False):
        shape.accept(t)
    assert shape.base > 100_000 and len(shape.chars) < 3 * 4096


def test_the_service_closes_a_stalled_array_where_the_grammar_allows(tokenizer):
    """Through the grammar service (llguidance): once the array's items repeat, the next mask after an item keeps
    only tokens that close it; with minItems not yet met the grammar decides, and the array goes on."""
    bitmask = allocate_bitmask(2, len(tokenizer))
    svc = guarded_service(tokenizer, bitmask)
    tag = {"type": "object", "properties": {"Key": {"type": "string"}, "Value": {"type": "string"}}}
    free = {"type": "object", "properties": {"Tags": {"type": "array", "items": tag}}, "required": ["Tags"]}
    many = {"type": "object", "properties": {"Tags": {"type": "array", "items": tag, "minItems": 20}}}
    close = tokenizer.convert_tokens_to_ids("]")
    comma = tokenizer.convert_tokens_to_ids(",")
    try:
        compile_schemas(svc, {"free": free, "many": many})
        item = '{"Key": "1234567890", "Value": "1234567890"}'
        quote_brace_comma, quote_brace = tokenizer.convert_tokens_to_ids(['"},', '"}'])
        text = '{"Tags": [' + ", ".join([item] * 3)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for i, t in enumerate(tokens):
            if t == quote_brace:  # the third copy's end: were it a copy, it could be the last; it is written apart
                assert not allowed(bitmask, 0, quote_brace_comma) and allowed(bitmask, 0, quote_brace)
            reply = svc.step(GrammarStepReq(i, [("free", t), ("many", t)], [("free", 0), ("many", 1)], []))
        assert quote_brace in tokens
        assert reply.loop_bans == 1
        assert allowed(bitmask, 0, close) and not allowed(bitmask, 0, comma)
        row = bitmask[0].numpy().view("uint32")
        kept = [t for t in range(len(tokenizer)) if (int(row[t >> 5]) >> (t & 31)) & 1]
        assert kept and all(svc.json_tokens.texts[t].lstrip()[:1] == "]" for t in kept)
        assert allowed(bitmask, 1, comma) and not allowed(bitmask, 1, close)  # 20 items first

        # the model ends items with '"},' (one token): in the next item, those are dropped, so it can be the last
        last = tokenizer.encode(',\n{"Key": "1234567890", "Value": "1234', add_special_tokens=False)
        for i, t in enumerate(last, len(tokens)):
            reply = svc.step(GrammarStepReq(i, [("free", t), ("many", t)], [("free", 0), ("many", 1)], []))
        assert not allowed(bitmask, 0, quote_brace_comma) and allowed(bitmask, 0, quote_brace)
        assert allowed(bitmask, 1, quote_brace)  # (the guard does not know the minItems: it drops them there too)
    finally:
        svc.close()


def test_a_key_may_not_end_as_one_its_object_already_has(tokenizer):
    """An open object (additionalProperties): after `"type": 1, "type` the tokens that would close the key (`":`,
    `"`, ...) are not in the mask, so the model writes another character; in an object without that key they are.
    A new user's outputs had `{..., "type": -1, "data": -1, "type": -1}`, which validates (json.loads keeps the
    last value) yet reads differently to a parser that keeps the first."""
    bitmask = allocate_bitmask(2, len(tokenizer))
    svc = guarded_service(tokenizer, bitmask)
    schema = {"type": "object", "additionalProperties": {"type": "integer"}}
    close_key = tokenizer.convert_tokens_to_ids('":')
    try:
        compile_schemas(svc, {"again": schema, "other": schema})
        again = tokenizer.encode('{"type": 1, "type', add_special_tokens=False)
        other = tokenizer.encode('{"kind": 1, "type', add_special_tokens=False)
        assert len(again) == len(other)
        for i, (a, o) in enumerate(zip(again, other)):
            reply = svc.step(GrammarStepReq(i, [("again", a), ("other", o)], [("again", 0), ("other", 1)], []))
        assert reply.loop_bans == 1
        assert not allowed(bitmask, 0, close_key) and allowed(bitmask, 1, close_key)
        assert allowed(bitmask, 0, tokenizer.convert_tokens_to_ids("s"))  # "types" is another key
    finally:
        svc.close()


def test_unique_arrays_are_found_by_name_through_refs_and_combinators():
    tag = {"type": "object", "properties": {"Key": {"type": "string"}, "Value": {"type": "string"}}}
    schema = {
        "type": "object",
        "definitions": {
            "Tag": tag,
            "Tags": {"type": "array", "items": {"$ref": "#/definitions/Tag"}, "uniqueItems": True},
        },
        "properties": {
            "Tags": {"$ref": "#/definitions/Tags"},
            "Ids": {"anyOf": [{"type": "null"}, {"type": "array", "uniqueItems": True}]},
            "Steps": {"type": "array", "items": {"type": "object", "properties": {"Args": {"uniqueItems": True}}}},
            "Notes": {"type": "array"},
        },
    }
    found = unique_arrays(json.dumps(schema))
    assert found == UniqueArrays(frozenset({"Tags", "Ids", "Args"}), root=False)
    assert unique_arrays(json.dumps({"type": "array", "uniqueItems": True})).root
    assert unique_arrays("not json") == UniqueArrays()


def test_an_item_of_a_unique_array_may_not_end_as_a_copy(tokenizer):
    """Held-out outputs failed the last check with the same tag object twice in a uniqueItems array: while the last
    string of an item that so far equals an earlier one is written, the tokens that would end it the same way are
    banned (and only there: another value, another key, or an array without uniqueItems is left alone)."""
    json_tokens = JsonTokens.of(tokenizer, len(tokenizer))
    item = '{"Key": "1234567890", "Value": "1234567890"}'

    def endings(text: str, keys=frozenset({"Tags"})) -> set[str]:
        shape = JsonShape(json_tokens, keys)
        for t in tokenizer.encode(text, add_special_tokens=False):
            shape.accept(t)
        return {json_tokens.texts[t] for t in shape.duplicate_endings()}

    second = '{"Tags": [' + item + ', {"Key": "1234567890", "Value": "1234567890'
    copies = endings(second)
    assert {'"}', '"},'} <= copies and all(t.startswith('"') for t in copies)
    short = endings(second[:-1])  # one character short: only a token that writes it and the quote ends a copy
    assert all(t.startswith('0"') for t in short)  # (digits are tokens of their own in this vocabulary: none)
    assert not endings(second, keys=frozenset())  # no uniqueItems: copies are the schema's business
    assert not endings('{"Tags": [' + item + ', {"Key": "1234567890')  # the key's string: the item goes on after it
    assert not endings('{"Tags": [' + item + ', {"Key": "1234567890", "Value": "999')  # differs already
    strings = endings('{"Tags": ["a-b", "a-b')
    assert '"' in strings and '",' in strings
    assert endings('["x", "x', keys=frozenset()) == set()
    root = JsonShape(json_tokens, frozenset(), unique_root=True)
    for t in tokenizer.encode('["x", "x', add_special_tokens=False):
        root.accept(t)
    assert '"' in {json_tokens.texts[t] for t in root.duplicate_endings()}


def test_the_service_keeps_a_unique_array_from_repeating_an_item(tokenizer):
    """Through the grammar service (llguidance): the same tokens in a uniqueItems array and in a plain one; in the
    unique one the copy's ending is not in the mask, in the plain one it is; after the altered copy the unique array
    may only close."""
    bitmask = allocate_bitmask(2, len(tokenizer))
    svc = guarded_service(tokenizer, bitmask)
    tag = {
        "type": "object",
        "properties": {"Key": {"type": "string"}, "Value": {"type": "string"}},
        "required": ["Key", "Value"],
        "additionalProperties": False,
    }
    unique = {"type": "object", "properties": {"Tags": {"type": "array", "items": tag, "uniqueItems": True}}}
    plain = {"type": "object", "properties": {"Tags": {"type": "array", "items": tag}}}
    end = tokenizer.convert_tokens_to_ids('"}')
    try:
        compile_schemas(svc, {"unique": unique, "plain": plain})
        item = '{"Key": "1234567890", "Value": "1234567890"}'
        text = '{"Tags": [' + item + ', {"Key": "1234567890", "Value": "1234567890'
        for i, t in enumerate(tokenizer.encode(text, add_special_tokens=False)):
            reply = svc.step(GrammarStepReq(i, [("unique", t), ("plain", t)], [("unique", 0), ("plain", 1)], []))
        assert reply.loop_bans >= 1
        assert not allowed(bitmask, 0, end) and allowed(bitmask, 1, end)
        assert allowed(bitmask, 0, tokenizer.convert_tokens_to_ids("0"))  # it may write another character
        # the altered copy ends the array: a model that copies items would write near-copies next
        n = len(tokenizer.encode(text, add_special_tokens=False))
        for i, t in enumerate(tokenizer.convert_tokens_to_ids(["1", '"}']), n):
            svc.step(GrammarStepReq(i, [("unique", t), ("plain", t)], [("unique", 0), ("plain", 1)], []))
        comma, close = tokenizer.convert_tokens_to_ids([",", "]"])
        assert allowed(bitmask, 0, close) and not allowed(bitmask, 0, comma)
        assert allowed(bitmask, 1, comma)
    finally:
        svc.close()


def test_the_closed_sets_of_unique_arrays_are_found():
    """Items drawn from a few scalars (enum, const, booleans, a narrow integer range, unions and refs of those) are a
    closed set; free strings, wide ranges, non-ASCII values, and a name shared with an array that allows copies are
    not."""

    def domains(items: dict, **extra) -> dict:
        schema = {"type": "object", "properties": {"a": {"type": "array", "items": items, "uniqueItems": True}}}
        return dict(unique_arrays(json.dumps(schema | extra)).domains)

    assert domains({"enum": ["Mon", "Tue"]}) == {"a": frozenset({'"Mon"', '"Tue"'})}
    assert domains({"type": "boolean"}) == {"a": frozenset({"true", "false"})}
    assert domains({"type": "integer", "exclusiveMinimum": 0, "maximum": 10, "multipleOf": 3}) == {
        "a": frozenset({"3", "6", "9"})
    }
    refs = {"$defs": {"c": {"anyOf": [{"const": "x"}, {"const": 2}, {"type": "null"}]}}}
    assert domains({"$ref": "#/$defs/c"}, **refs) == {"a": frozenset({'"x"', "2", "null"})}
    assert domains({"enum": ["x", 1, True], "type": "string"}) == {"a": frozenset({'"x"'})}
    assert domains({"enum": [1, 2], "allOf": [{"enum": [2, 3]}]}) == {"a": frozenset({"2"})}
    for open_items in (
        {"type": "string"},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "integer", "minimum": 0},
        {"enum": ["é", "e"]},
        {"enum": [{"k": 1}]},
        {"anyOf": [{"const": "x"}, {"type": "string"}]},
    ):
        assert domains(open_items) == {}, open_items
    shared = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "boolean"}}}}
    assert domains({"type": "boolean"}, **{"$defs": {"other": shared}}) == {}
    root = unique_arrays(json.dumps({"type": "array", "items": {"enum": [0, 1]}, "uniqueItems": True}))
    assert root.root and root.root_domain == frozenset({"0", "1"})


def choices_after(tokenizer, json_tokens: JsonTokens, text: str, values: set[str]) -> set[str]:
    """The tokens JsonShape keeps after `text`, for an output that is a unique array of `values`."""
    shape = JsonShape(json_tokens, unique_root=True, root_domain=frozenset(values))
    for t in tokenizer.encode(text, add_special_tokens=False):
        shape.accept(t)
    return {json_tokens.texts[t] for t in shape.unique_choices()}


def test_an_item_of_a_closed_set_is_kept_to_the_values_not_used(tokenizer):
    json_tokens = JsonTokens.of(tokenizer, len(tokenizer))
    days = {'"Mon"', '"Tue"', '"Wed"'}
    inside = choices_after(tokenizer, json_tokens, '["Mon", "Tue", "', days)
    assert "Wed" in inside and not any(t.startswith(("M", "T")) for t in inside)
    assert choices_after(tokenizer, json_tokens, '["Mon", "Tue", "W', days) <= {"e", "ed", 'ed"', 'ed"]', 'ed"],'}
    # the last value written: the array may only end (whitespace or "]"), no comma
    ends = choices_after(tokenizer, json_tokens, '["Mon", "Tue", "Wed"', days)
    assert "]" in ends and " " in ends and not any(t.lstrip().startswith(",") for t in ends)
    assert "," in choices_after(tokenizer, json_tokens, '["Mon", "Tue"', days)  # one value is left
    numbers = choices_after(tokenizer, json_tokens, "[1, 2, ", {"0", "1", "2", "3"})
    assert {"0", "3"} <= numbers and not numbers & {"1", "2"}
    assert not any(
        t.lstrip().startswith(",") for t in choices_after(tokenizer, json_tokens, "[true, false", {"true", "false"})
    )
    assert choices_after(tokenizer, json_tokens, '["Mon", {', days) == set()  # not an item of the set: left alone


def test_random_walks_fill_unique_arrays_of_closed_sets_without_copies(tokenizer):
    """Random walks through the service's masks (the adversarial sampler of random weights) over unique arrays of
    enums, booleans and an integer range, some asking for every value: every finished output validates. Without the
    guard, most of the same walks write a copy. (`auto` serves them with llguidance over the schema without
    uniqueItems, which no backend enforces; xgrammar refuses them.)"""
    schemas = {
        "days": {
            "type": "object",
            "properties": {
                "days": {"type": "array", "items": {"enum": ["Mon", "Tue", "Wed", "Thu"]}, "uniqueItems": True}
            },
            "required": ["days"],
        },
        "all_days": {
            "type": "array",
            "items": {"enum": ["Mon", "Tue", "Wed", "Thu"]},
            "uniqueItems": True,
            "minItems": 4,
        },
        "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 2},
        "digits": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 3},
            "uniqueItems": True,
            "minItems": 4,
        },
    }
    whitespace = {i for i, t in enumerate(JsonTokens.of(tokenizer, len(tokenizer)).texts) if t and not t.strip()}

    def walks(guard: bool, seeds: range) -> list[tuple[str, str]]:
        bitmask = allocate_bitmask(len(schemas), len(tokenizer))
        svc = GrammarService(
            tokenizer, len(tokenizer), [EOS], GrammarOptions(loop_guard=guard), bitmask, fill_threads=0,
            compile_timeout_s=30,
        )  # fmt: skip
        out = []
        try:
            for seed in seeds:
                rng = random.Random(seed)
                rids = {name: f"{name}-{seed}" for name in schemas}
                answers = {}  # a grammar compiled before is answered at once
                for name, schema in schemas.items():
                    spec = GrammarRequest("json_schema", json.dumps(schema))
                    if (answer := svc.submit(GrammarCompileReq(rids[name], spec))) is not None:
                        answers[answer.rid] = answer
                answers |= collect(svc, set(rids.values()) - set(answers))
                assert all(r.error is None for r in answers.values())
                texts = {name: [] for name in schemas}
                live = list(schemas)
                accept: list[tuple[str, int]] = []
                for step in range(160):
                    fill = [(rids[name], row) for row, name in enumerate(schemas) if name in live]
                    svc.step(GrammarStepReq(step, accept, fill, []))
                    accept = []
                    for row, name in enumerate(schemas):
                        if name not in live:
                            continue
                        words = bitmask[row].numpy().view(np.uint32)
                        allowed = [i for i in np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))]
                        if EOS in allowed:
                            live.remove(name)
                            out.append((name, "".join(texts[name])))
                            continue
                        token = int(rng.choice([t for t in allowed if t not in whitespace] or allowed))
                        accept.append((rids[name], token))
                        texts[name].append(tokenizer.decode([token]))
                    if not live:
                        break
                svc.step(GrammarStepReq(999, [], [], [rids[n] for n in schemas]))
        finally:
            svc.close()
        return out

    guarded = walks(True, range(6))
    assert len(guarded) >= 20  # most walks finish
    for name, text in guarded:
        jsonschema.validate(json.loads(text), schemas[name])
    copies = 0
    for name, text in walks(False, range(3)):
        try:
            jsonschema.validate(json.loads(text), schemas[name])
        except jsonschema.ValidationError:
            copies += 1
    assert copies >= 4


def test_a_closed_set_array_is_not_closed_early_by_the_copy_rule(tokenizer):
    """An item on its way to a value that extends a used one ("ab" after "a") looked like a copy in the making at
    `"a`: the copy rule then stalled the array after it and kept only `]`, with a value left."""
    json_tokens = JsonTokens.of(tokenizer, len(tokenizer))
    single = {t: i for i, t in enumerate(json_tokens.texts) if len(t) == 1}
    unique = UniqueArrays(frozenset({"t"}), False, (("t", frozenset({'"a"', '"ab"', '"c"'})),))
    guard = LoopGuard(DigitTokens.of(tokenizer), json_tokens, unique)
    for c in '{"t": ["a", "ab"':
        guard.accept(single[c])
        guard.banned()
    keep, _ = guard.narrowing()
    assert keep is not None
    kept = {json_tokens.texts[i] for i in np.flatnonzero(np.unpackbits(keep.view(np.uint8), bitorder="little"))}
    assert "," in kept and "]" in kept  # "c" is left: the array may go on, or end
    for c in ', "c"':
        guard.accept(single[c])
        guard.banned()
    keep, _ = guard.narrowing()
    kept = {json_tokens.texts[i] for i in np.flatnonzero(np.unpackbits(keep.view(np.uint8), bitorder="little"))}
    assert "]" in kept and "," not in kept  # none left
