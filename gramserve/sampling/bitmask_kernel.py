"""Triton kernel: apply grammar bitmasks to logits rows in place (imported only on CUDA).

`pairs[i] = (logits row, mask row)`; `masks` holds one bitmask per constrained request (its slot). Bit j of
word w set = token 32 * w + j allowed; columns at or past `covered` (logits wider than the grammar's
vocabulary) are disallowed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _apply_masks_kernel(logits, masks, pairs, stride_logits, stride_masks, covered, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(pairs + 2 * i).to(tl.int64)
    slot = tl.load(pairs + 2 * i + 1).to(tl.int64)
    in_grammar = cols < covered
    words = tl.load(masks + slot * stride_masks + cols // 32, mask=in_grammar, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits + row * stride_logits + cols, float("-inf"), mask=(cols < vocab) & ~(allowed & in_grammar))


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, pairs: torch.Tensor, covered: int) -> None:
    """logits [B, V] (unit column stride); masks [slots, words] int32 and pairs [n, 2] int32 (contiguous), all on
    the logits' device."""
    n, vocab = pairs.shape[0], logits.shape[-1]
    if n == 0:
        return
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_masks_kernel[grid](logits, masks, pairs, logits.stride(0), masks.stride(0), covered, vocab, BLOCK=BLOCK)
