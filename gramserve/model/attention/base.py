"""The attention-backend interface: write the new K/V into the paged cache, attend over each request's slots.

Backends that can run inside a captured CUDA graph (decode only) also implement the three `cuda_graph_*`
hooks: static buffers are made once, metadata for a padded batch size is built at capture, and refreshed
in place (same tensors) before every replay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gramserve.model.forward_batch import ForwardBatch
from gramserve.model.kv_cache import KVCache


class AttentionBackend(ABC):
    name = "base"
    supports_cuda_graph = False

    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute once per forward what every layer needs (indices, masks); store it in batch.attn_metadata."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens, stored into the KV cache first (None: already
        stored by the caller). Returns [T, Hq * D]."""

    # --- CUDA graphs (decode) ---------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_context: int) -> None:
        raise NotImplementedError(f"{self.name} attention does not support CUDA graphs")

    def cuda_graph_capture_metadata(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor
    ):
        """Metadata for a decode batch of `bs` rows whose tensors are the graph's static inputs."""
        raise NotImplementedError

    def cuda_graph_replay_metadata(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        req_to_token: torch.Tensor,
    ) -> None:
        """Refresh the captured metadata of batch size `bs` in place for the batch about to replay."""
        raise NotImplementedError
