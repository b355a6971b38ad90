"""What one model forward needs to know about the batch: tokens, positions, KV slots, per-request lengths."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly over a cached prefix: several new tokens per request
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] all new tokens of the batch, request after request
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each new token is written to
    req_pool_indices: torch.Tensor  # [B] row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] KV length after this forward (prefix + new)
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # [B] tokens already in the KV cache
    extend_seq_lens_cpu: list[int]  # [B] new tokens
    req_to_token: torch.Tensor  # [max_reqs, max_context] slot table
    return_all_logits: bool = False  # logits for every new token instead of the last of each request
    attn_metadata: Any = None  # filled by the attention backend, shared by all layers
    lora: Any = None  # lora.batch.LoRABatch: which token rows use which adapter slot; None: no adapter rows
    # Multimodal: (rows of input_ids [N], embeddings [N, hidden]) that replace those tokens' embeddings (an image's
    # placeholder tokens get its vision features); None: text only.
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.input_ids.device, non_blocking=True)
