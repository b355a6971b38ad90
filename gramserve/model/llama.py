"""Our decoder for the Llama family and its close relatives (Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm).

One forward serves prefill, extend over a cached prefix and decode: the attention backend hides the difference.
Weights are stored fused (qkv_proj, gate_up_proj) to cut the number of matmuls per layer.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.model_config import ModelConfig, UnsupportedModelError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with `residual`: the residual stream becomes x + residual, returns (its norm, it)."""
        if x.is_cuda:
            from gramserve.model import fused_ops

            if residual is not None:
                return fused_ops.add_rmsnorm(x, residual, self.weight, self.eps), residual
            return fused_ops.rmsnorm(x, self.weight, self.eps)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    scaling = cfg.rope_scaling
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        return scaled.float()
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE with a cos/sin table over all positions."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.register_buffer(
            "cos", torch.empty(max_positions, cfg.head_dim // 2, dtype=torch.float32), persistent=False
        )
        self.register_buffer("sin", torch.empty_like(self.cos), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    def reset_tables(self) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(positions, rope_inv_freq(self.cfg).to(self.cos.device))
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]."""
        if x.is_cuda:
            from gramserve.model import fused_ops

            return fused_ops.rope(x, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if qkv.is_cuda and self.q_norm is None:
            # One kernel: RoPE on q and k, and k/v written straight into their cache slots.
            from gramserve.model import fused_ops

            cache = backend.kv_cache
            q = fused_ops.rope_and_store(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                rope.cos,
                rope.sin,
                positions,
                cache.k[self.layer],
                cache.v[self.layer],
                batch.out_cache_loc,
            )
            return self.o_proj(backend.forward(q, None, None, self.layer, batch, self.scale))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q), rope(positions, k)
        return self.o_proj(backend.forward(q, k, v, self.layer, batch, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from gramserve.model import fused_ops

            return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, rope, backend, batch):
        """x: the previous layer's output, residual: the stream before it (None at the first layer)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, backend, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits: one row per request (its last new token), or per new token."""
        if batch.attn_metadata is None:  # a CUDA graph's batch comes with its metadata
            backend.init_forward_metadata(batch)
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch.positions, self.rope, backend, batch)
        if not batch.return_all_logits and batch.mode != ForwardMode.DECODE:  # decode: every token is a last one
            last = batch.last_token_indices()
            x, residual = x[last], residual[last]
        x, _ = self.norm(x, residual)
        return F.linear(x, self.lm_head_weight).float()

    # --- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters."""
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in fused:
                    fused_name, shard = fused[part]
                    target = ".".join(parts[:i] + [fused_name] + parts[i + 1 :])
                    break
            if target not in params:
                raise UnsupportedModelError(f"unexpected weight {name!r} for {self.cfg.architecture}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    param[self._shard_slice(target, shard)].copy_(tensor)
            loaded.add(f"{target}#{shard}")
        self._check_all_loaded(loaded, fused)

    def _shard_slice(self, target: str, shard: int) -> slice:
        cfg = self.cfg
        if "qkv_proj" in target:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            bounds = [0, q, q + kv, q + 2 * kv]
        else:
            bounds = [0, cfg.intermediate_size, 2 * cfg.intermediate_size]
        return slice(bounds[shard], bounds[shard + 1])

    def _check_all_loaded(self, loaded: set[str], fused: dict) -> None:
        missing = []
        for name in dict(self.named_parameters()):
            if "qkv_proj" in name:
                shards = 3
            elif "gate_up_proj" in name:
                shards = 2
            else:
                shards = 0
            keys = [f"{name}#{s}" for s in range(shards)] if shards else [f"{name}#None"]
            missing += [k for k in keys if k not in loaded]
        if missing:
            raise UnsupportedModelError(f"weights missing from the checkpoint: {missing[:5]}")

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights of realistic scale, for speed runs at real shapes without a checkpoint."""
        device = self.embed_tokens.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.uniform_(-0.02, 0.02, generator=gen)
