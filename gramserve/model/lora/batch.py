"""Which rows of a forward batch use which adapter slot: contiguous segments of tokens sharing one slot.

Rows without an adapter belong to no segment. The scheduler keeps decode rows ordered by slot, so a decode batch has
at most one segment per adapter in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 16  # rows per block of the GPU kernels (triton_ops.py; tl.dot's smallest tile)


@dataclass
class LoRABatch:
    segments: list[tuple[int, int, int]]  # (first token, tokens, slot)
    starts: torch.Tensor  # [S] int32 on the device, the same segments (a CUDA graph's are padded with empty ones)
    lengths: torch.Tensor
    slots: torch.Tensor
    m_split: int  # GPU kernels: programs (lanes) sharing one segment's rows


def segments_of(row_slots: list[int], row_tokens: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Runs of rows with the same slot (>= 0), as token ranges; `row_tokens`: tokens of each row (default 1)."""
    segments, start = [], 0
    for i, slot in enumerate(row_slots):
        n = 1 if row_tokens is None else row_tokens[i]
        if slot >= 0:
            if segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == start:
                first, length, _ = segments[-1]
                segments[-1] = (first, length + n, slot)
            else:
                segments.append((start, n, slot))
        start += n
    return segments


def make_lora_batch(
    row_slots: list[int], device: torch.device, row_tokens: list[int] | None = None
) -> LoRABatch | None:
    """The LoRA segments of a batch; None when no row uses an adapter."""
    segments = segments_of(row_slots, row_tokens)
    if not segments:
        return None
    table = torch.tensor(segments, dtype=torch.int32).t().contiguous()
    if device.type != "cpu":
        table = table.to(device, non_blocking=True)
    longest = max(n for _, n, _ in segments)
    return LoRABatch(segments, table[0], table[1], table[2], m_split=min(-(-longest // BLOCK_M), 64))
