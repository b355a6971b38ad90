"""Call markers that are special tokens (Mistral's [TOOL_CALLS], DeepSeek's, Kimi's) in constrained calls.

A tokenizer with `[TOOL_CALLS]` added as a special token stands in for Mistral's: with the marker declared
as a text token (what the launcher does for the selected tool-call parser), the grammar accepts the single
special token the model emits for it; without it, special tokens never match text.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from gramserve.grammar.backends import GrammarSpec, create_backend
from gramserve.grammar.backends.base import GrammarOptions
from gramserve.model.loader import default_tokenizer_dir
from gramserve.parsers.tool_calls import ToolFunction, get_tool_call_parser
from gramserve.sampling.bitmask import allocate_bitmask

WEATHER = ToolFunction(
    "get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
)


@pytest.fixture(scope="module")
def mistral_like_tokenizer():
    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok


def walk(backend, compiled, ids: list[int]) -> bool:
    """Whether the matcher allows every token of `ids` (checking each mask) and can end after them."""
    m = backend.matcher(compiled)
    mask = allocate_bitmask(1, backend.vocab_size)
    for t in ids:
        m.fill_bitmask(mask, 0)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not m.accept_token(t):
            return False
    return m.can_terminate()


@pytest.mark.parametrize("declared, expected", [(("[TOOL_CALLS]",), True), ((), False)])
def test_special_marker_token_in_a_constrained_call(mistral_like_tokenizer, declared, expected):
    tok = mistral_like_tokenizer
    marker_id = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker_id in tok.all_special_ids
    parser = get_tool_call_parser("mistral")([WEATHER])
    assert "[TOOL_CALLS]" in parser.markers
    backend = create_backend("xgrammar", tok, len(tok), [tok.eos_token_id], GrammarOptions(text_tokens=declared))
    tag = parser.structural_tag("required", True)
    compiled = backend.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    call = parser.render_calls([("get_weather", {"city": "Paris"})])
    assert call.startswith("[TOOL_CALLS]")
    ids = [marker_id] + tok.encode(call[len("[TOOL_CALLS]") :], add_special_tokens=False) + [tok.eos_token_id]
    assert walk(backend, compiled, ids) is expected
    # The parsed output of those tokens (special tokens kept) is the call.
    text = tok.decode(ids[:-1], skip_special_tokens=False)
    (parsed,) = parser.parse(text).calls
    assert parsed.name == "get_weather" and json.loads(parsed.arguments) == {"city": "Paris"}
