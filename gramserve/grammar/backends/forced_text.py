"""The tokenizer's own token where a grammar forces the next characters (for xgrammar's masks).

Where a grammar allows one continuation only for its next characters (a property name, the rest of an enum value,
the `": ` after a key), xgrammar allows every token that spells a piece of it: after `{"`, with "name" the only
key, "n", "na", "nam" and "name". A model never saw `"n` `ame"` in training. A greedy SmolLM2 took "n" (logprob
-0.69 against -0.70 for "name") and wrote `"name": "name", "age": 1` from there, where llguidance, which allows
only "name", gave `"name": "Mara"` (a new user's finding: the same request changed its answer once auto moved
the schema to xgrammar).

`ForcedText.restrict` makes xgrammar's masks do what llguidance's do: the tokens that end inside the forced text
are cleared, except the first token of the tokenizer's own encoding of that text; tokens that cover the whole of
it, and whatever the grammar allows past it, stay. If the tokenizer's first token is not allowed (its encoding of
the text alone differs from the grammar's view), the mask is left as it is: it never ends up empty.
"""

from __future__ import annotations

import numpy as np
import torch

CACHE_LIMIT = 65_536  # forced texts remembered (each a few token ids); cleared when full


class ForcedText:
    def __init__(self, tokenizer, tokens: list[bytes | None]):
        """`tokens`: each token id's bytes (None for tokens that are not text)."""
        self._tokenizer = tokenizer
        self._tokens = tokens
        self._by_bytes: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(tokens):
            if text:
                self._by_bytes.setdefault(text, []).append(token_id)
        # forced text -> (the tokenizer's first token, the tokens ending inside the text), or None: nothing to clear
        self._plans: dict[str, tuple[int, tuple[int, ...]] | None] = {}

    def restrict(self, bitmask: torch.Tensor, row: int, forced: str) -> None:
        """Clear from `bitmask[row]` the tokens that end inside `forced` (the text the grammar forces next) but the
        tokenizer's own first token of it."""
        if not forced or (len(forced) == 1 and forced.isascii()):
            return  # no token ends inside a single byte
        plan = self._plans.get(forced, False)
        if plan is False:
            plan = self._plan(forced)
            if len(self._plans) >= CACHE_LIMIT:
                self._plans.clear()
            self._plans[forced] = plan
        if plan is None:
            return
        first, inside = plan
        words = bitmask[row].numpy().view(np.uint32)
        if not (int(words[first >> 5]) >> (first & 31)) & 1:
            return
        for token in inside:
            words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)

    def _plan(self, forced: str) -> tuple[int, tuple[int, ...]] | None:
        data = forced.encode("utf-8", "surrogatepass")
        try:
            ids = self._tokenizer.encode(forced, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - text the tokenizer cannot take: leave the mask alone
            return None
        if not ids:
            return None
        first = ids[0]
        inside = [t for k in range(1, len(data)) for t in self._by_bytes.get(data[:k], ()) if t != first]
        first_bytes = self._tokens[first] if 0 <= first < len(self._tokens) else None
        if not inside or not first_bytes or not data.startswith(first_bytes):
            return None  # e.g. a tokenizer that adds a prefix space: its token is not a piece of the text
        return first, tuple(inside)
