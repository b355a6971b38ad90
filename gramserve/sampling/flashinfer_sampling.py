"""Sort-free temperature / top-k / top-p sampling on CUDA with FlashInfer's rejection-sampling kernels.

The torch path in `Sampler` sorts every row over the whole vocabulary when a request sets top_k or top_p
(128k columns for Llama 3, on every step). These kernels sample without sorting: a fused softmax with each
row's temperature, then rejection sampling that honours each row's top-k and top-p together (FlashInfer's
"joint" order, the same set the torch path keeps: the k most likely tokens that also lie in the top-p nucleus
of the full distribution).

Rows with a seed or min_p stay on the torch path: a seeded request's noise is a hash of (seed, step, token)
(seeded_noise.py), so the same seed gives the same tokens on every device and in every batch.
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("auto", "torch", "flashinfer")


def resolve_sampling_backend(name: str, device: torch.device) -> str:
    """auto: flashinfer on CUDA when it is installed, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown sampling backend {name!r} (expected one of {', '.join(BACKENDS)})")
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer sampling backend needs a CUDA device")
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


class FlashInferSampling:
    """One batch of unseeded random rows: logits -> sampled ids, without sorting the vocabulary."""

    def __init__(self, device: torch.device):
        import flashinfer.sampling

        self._ops = flashinfer.sampling
        # The kernels' randomness comes from this generator's (seed, offset), advanced on every call. Without one,
        # FlashInfer 0.5 makes a fresh generator per call, so every step would draw the same numbers.
        self.generator = torch.Generator(device=device)
        self.generator.seed()

    def sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor:
        """logits [B, V] float32; temperature [B] (> 0); top_k [B] int (V: no limit) or None when no row sets
        it; top_p [B] float (1.0: no limit) or None. Returns [B] int64 ids."""
        ops, gen = self._ops, self.generator
        probs = ops.softmax(logits, temperature)
        if top_k is not None and top_p is not None:
            ids = ops.top_k_top_p_sampling_from_probs(probs, top_k, top_p, filter_apply_order="joint", generator=gen)
        elif top_k is not None:
            ids = ops.top_k_sampling_from_probs(probs, top_k, generator=gen)
        elif top_p is not None:
            ids = ops.top_p_sampling_from_probs(probs, top_p, generator=gen)
        else:
            ids = ops.sampling_from_probs(probs, generator=gen)
        return ids.long()
