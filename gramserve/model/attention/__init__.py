"""Attention backends behind one interface; `create_backend` picks one by name."""

from __future__ import annotations

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.kv_cache import KVCache


def create_backend(name: str, kv_cache: KVCache) -> AttentionBackend:
    if name == "torch":
        from gramserve.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_cache)
    raise ValueError(f"unknown attention backend {name!r}")
