"""The attention-backend interface: write the new K/V into the paged cache, attend over each request's slots."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gramserve.model.forward_batch import ForwardBatch
from gramserve.model.kv_cache import KVCache


class AttentionBackend(ABC):
    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute once per forward what every layer needs (indices, masks); store it in batch.attn_metadata."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens. Returns [T, Hq * D]."""
