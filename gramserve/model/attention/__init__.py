"""Attention backends behind one interface; `create_backend` picks one by name ("auto": the fastest usable).

Names: torch, flashinfer, triton, and flashinfer_triton (FlashInfer prefill + Triton decode, what `auto`
picks on CUDA in bf16/fp16 when both are installed).
"""

from __future__ import annotations

import importlib.util

import torch

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.kv_cache import KVCache

GPU_BACKENDS = ("flashinfer", "triton", "flashinfer_triton")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto on CUDA: FlashInfer prefill + Triton decode (bf16/fp16), else flashinfer, else triton; CPU: torch."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    if dtype in (torch.bfloat16, torch.float16) and _installed("flashinfer"):
        return "flashinfer_triton" if _installed("triton") else "flashinfer"
    if _installed("triton"):
        return "triton"
    return "torch"


def create_backend(name: str, kv_cache: KVCache, num_heads: int = 0) -> AttentionBackend:
    if name == "torch":
        from gramserve.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_cache)
    if name in GPU_BACKENDS and kv_cache.device.type != "cuda":
        raise ValueError(f"the {name} attention backend needs a CUDA device")
    if name == "flashinfer":
        from gramserve.model.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(kv_cache, num_heads)
    if name == "triton":
        from gramserve.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_cache, num_heads)
    if name == "flashinfer_triton":
        from gramserve.model.attention.hybrid_backend import HybridAttentionBackend

        return HybridAttentionBackend(
            create_backend("flashinfer", kv_cache, num_heads), create_backend("triton", kv_cache, num_heads)
        )
    raise ValueError(f"unknown attention backend {name!r}")
