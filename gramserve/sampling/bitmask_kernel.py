"""Triton kernel: apply packed grammar bitmasks to logits rows in place (imported only on CUDA).

Each mask row of `masks` is [logits row index, bitmask words...] (int32), so one host-to-device copy carries
both the rows to mask and their masks. Bit j of word w set = token 32 * w + j allowed; columns at or past
`covered` (logits wider than the grammar's vocabulary) are disallowed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _apply_masks_kernel(logits, masks, stride_logits, stride_masks, covered, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask_row = masks + i.to(tl.int64) * stride_masks
    row = tl.load(mask_row).to(tl.int64)
    in_grammar = cols < covered
    words = tl.load(mask_row + 1 + cols // 32, mask=in_grammar, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits + row * stride_logits + cols, float("-inf"), mask=(cols < vocab) & ~(allowed & in_grammar))


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, covered: int) -> None:
    """logits [B, V] (contiguous rows); masks [n, 1 + words] int32 on the same device, one per row to mask."""
    n, vocab = masks.shape[0], logits.shape[-1]
    if n == 0:
        return
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_masks_kernel[grid](logits, masks, logits.stride(0), masks.stride(0), covered, vocab, BLOCK=BLOCK)
