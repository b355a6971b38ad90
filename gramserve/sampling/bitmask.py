"""Token bitmasks: allocate them, set and check their bits, and apply them to logits.

The layout is xgrammar's: int32 words, bit ``i % 32`` of word ``i // 32`` set when token ``i`` is allowed; one
row per constrained request. Grammar matchers write rows (``set_only_tokens``, ``set_token_bits``,
``clear_columns_from``, ``check_bitmask_row``); the sampler's side applies them (``apply_bitmask``;
``grammar_masks.MaskApplier`` on the serving path). Nothing here knows about grammars.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab_size/32)] with every token allowed (like xgrammar)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


# --- apply ----------------------------------------------------------------------------------------

_xgr_apply = None
_xgr_apply_broken: set[str] = set()
_XGR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what xgrammar's kernels take


_BIT_VALUES = [(1 << b) - (1 << 32) if b == 31 else 1 << b for b in range(32)]


def _torch_apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab = logits.shape[-1]
    bits = torch.tensor(_BIT_VALUES, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device, non_blocking=True).unsqueeze(-1) & bits) != 0).reshape(bitmask.shape[0], -1)
    n = min(vocab, allowed.shape[1])
    logits[:, :n].masked_fill_(~allowed[:, :n], float("-inf"))
    if n < vocab:  # logits wider than the bitmask: the extra columns are disallowed
        logits[:, n:] = float("-inf")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits of disallowed tokens become -inf. logits [rows, V] (or [V]), bitmask
    [rows, ceil(V/32)] int32 on CPU or on the logits' device."""
    global _xgr_apply
    squeeze = logits.dim() == 1
    lg = logits.unsqueeze(0) if squeeze else logits
    bm = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    if bm.dtype != torch.int32:
        raise TypeError("the bitmask must be int32")
    if bm.shape[0] != lg.shape[0]:
        raise ValueError(f"bitmask rows {bm.shape[0]} != logits rows {lg.shape[0]}")
    dev = lg.device.type
    if dev not in _xgr_apply_broken and lg.is_contiguous() and lg.dtype in _XGR_DTYPES:
        try:
            if _xgr_apply is None:
                from xgrammar import apply_token_bitmask_inplace as fn

                _xgr_apply = fn
            covered = min(lg.shape[-1], bm.shape[1] * 32)
            _xgr_apply(lg, bm.to(lg.device, non_blocking=True), vocab_size=covered)
            if covered < lg.shape[-1]:  # logits wider than the bitmask: extra columns disallowed
                lg[:, covered:] = float("-inf")
            return
        except Exception as e:  # noqa: BLE001 - e.g. no compiled kernel for this device
            logger.warning("xgrammar.apply_token_bitmask_inplace failed on %s (%s); using torch", dev, e)
            _xgr_apply_broken.add(dev)
    _torch_apply_bitmask(lg, bm)


# --- set and clear bits ---------------------------------------------------------------------------


def set_only_tokens(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Row ``row`` allows exactly ``token_ids``."""
    r = bitmask[row]
    r.zero_()
    for t in token_ids:
        w, b = divmod(int(t), 32)
        if w < r.shape[0]:
            r[w] |= _bit(b)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids: list[int], allowed: bool) -> None:
    r = bitmask[row]
    for t in token_ids:
        w, b = divmod(int(t), 32)
        if w < r.shape[0]:
            if allowed:
                r[w] |= _bit(b)
            else:
                r[w] &= ~_bit(b)


def clear_columns_from(bitmask: torch.Tensor, rows: int | Sequence[int], start: int) -> None:
    """Disallow every column >= start in one row, or in several rows at once."""
    w, b = divmod(start, 32)
    if w >= bitmask.shape[1] or (not isinstance(rows, int) and not rows):
        return
    idx = rows if isinstance(rows, int) else torch.tensor(rows, dtype=torch.long)
    if b:
        bitmask[idx, w] &= (1 << b) - 1  # keep bits below b
        w += 1
    if w < bitmask.shape[1]:
        bitmask[idx, w:] = 0


def _bit(b: int) -> int:
    """The int32 value with bit b set (bit 31 is the sign bit)."""
    return (1 << b) - (1 << 32) if b == 31 else 1 << b


# --- checks ---------------------------------------------------------------------------------------


def check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError("bitmask must be a 2-D int32 tensor")
    if bitmask.device.type != "cpu":
        raise ValueError("bitmask must be on the CPU")
    if bitmask.shape[1] < bitmask_words(vocab_size):
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; {bitmask_words(vocab_size)} needed")


def check_bitmask_row(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    check_bitmask(bitmask, vocab_size)
    r = bitmask[row]
    if not r.is_contiguous():
        raise ValueError("bitmask rows must be contiguous")
    return r
