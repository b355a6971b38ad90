"""Our decoder for the Llama family and its close relatives (Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm).

One forward serves prefill, extend over a cached prefix and decode: the attention backend hides the difference.
Weights are stored fused (qkv_proj, gate_up_proj) to cut the number of matmuls per layer.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.block_linear import BlockLinear
from gramserve.model.cpu_decode import DecodeLayers
from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.lora.linear import LoRAContext, LoRALinear
from gramserve.model.lora.pool import LoRAPool
from gramserve.model.model_config import ModelConfig, UnsupportedModelError
from gramserve.model.parallel import Partition, TPGroup
from gramserve.model.quant_weights import BlockWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = None  # the CPU kernel library (`use_cpu_kernels`): fp32 rows in one call

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rmsnorm(x); with `residual`: the residual stream becomes x + residual, returns (its norm, it)."""
        if x.is_cuda:
            from gramserve.model import fused_ops

            if residual is not None:
                return fused_ops.add_rmsnorm(x, residual, self.weight, self.eps), residual
            return fused_ops.rmsnorm(x, self.weight, self.eps)
        if self.kernels is not None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            from gramserve.model import cpu_kernels

            if residual is None:
                return cpu_kernels.rmsnorm(self.kernels, x, self.weight, self.eps, None)
            if residual.is_contiguous() and residual.shape == x.shape:  # the sum goes into `residual` in place
                return cpu_kernels.rmsnorm(self.kernels, x, self.weight, self.eps, residual), residual
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; 16-bit inputs keep HF's rounding below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
        self._gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self.cos.device.type != "meta":
            self.reset_tables()

    def reset_tables(self) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(positions, rope_inv_freq(self.cfg).to(self.cos.device))
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, D/2] for `positions`, gathered once per forward (every layer asks with the same
        tensor) rather than once per layer."""
        if self._gathered is None or self._gathered[0] is not positions:
            self._gathered = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self._gathered[1], self._gathered[2]

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]."""
        if x.is_cuda:
            from gramserve.model import fused_ops

            return fused_ops.rope(x, self.cos, self.sin, positions)
        cos, sin = self._tables(positions)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism); o_proj's partial sums are
    added over the ranks."""

    def __init__(self, cfg: ModelConfig, layer: int, part: Partition, tp: TPGroup):
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.num_kv_heads, self.head_dim = part.num_heads, part.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.kernels = None  # the CPU kernel library (`use_cpu_kernels`): RoPE and the K/V store in one call

    def _fused_rope_and_store(self, qkv: torch.Tensor):
        """The one-call RoPE + K/V store for this device (Triton on CUDA, the C kernel on a CPU), or None where the
        separate torch ops run (q/k norms between the projection and RoPE, no kernels)."""
        if self.q_norm is not None:
            return None
        if qkv.is_cuda:
            from gramserve.model import fused_ops

            return fused_ops.rope_and_store
        if self.kernels is not None and qkv.dim() == 2 and qkv.is_contiguous():
            from gramserve.model import cpu_kernels

            return functools.partial(cpu_kernels.rope_and_store, self.kernels)
        return None

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, backend, batch):
        """q, k, v of the new tokens, RoPE applied. k and v come back None where they went into their KV slots
        already (the fused RoPE + store); otherwise the attention backend stores them."""
        qkv = self.qkv_proj(x)
        fused = self._fused_rope_and_store(qkv)
        if fused is not None:
            cache = backend.kv_cache
            q = fused(qkv, self.num_heads, self.num_kv_heads, rope.cos, rope.sin, positions,
                      cache.k[self.layer], cache.v[self.layer], batch.out_cache_loc)  # fmt: skip
            return q, None, None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            return rope(positions, self.q_norm(q)), rope(positions, self.k_norm(k)), v
        # q and k are neighbours in qkv: rotate them in one go
        qk = rope(
            positions, qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        )
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def attend(self, q, k, v, backend: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        return backend.forward(q, k, v, self.layer, batch, self.scale)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(attn))


class MLP(nn.Module):
    """SwiGLU over this rank's intermediate features; down_proj's partial sums are added over the ranks."""

    def __init__(self, cfg: ModelConfig, part: Partition, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * part.intermediate_size, bias=False)
        self.down_proj = nn.Linear(part.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels = None  # the CPU kernel library (`use_cpu_kernels`): SiLU-and-multiply in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self._forward(x))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from gramserve.model import fused_ops

            return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            from gramserve.model import cpu_kernels

            return self.down_proj(cpu_kernels.silu_mul(self.kernels, gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding table; tokens outside them give zeros, and the all-reduce adds the
    rows that each rank looked up."""

    def __init__(self, cfg: ModelConfig, part: Partition, tp: TPGroup):
        super().__init__(part.vocab_per_rank if tp.size > 1 else cfg.vocab_size, cfg.hidden_size)
        self.tp, self.first = tp, part.vocab[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, part: Partition, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, part, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, part, tp)

    def forward(self, x, residual, positions, rope, backend, batch):
        """x: the previous layer's output, residual: the stream before it (None at the first layer)."""
        q, k, v, residual = self.before_attention(x, residual, positions, rope, backend, batch)
        return self.after_attention(self.self_attn.attend(q, k, v, backend, batch), residual)

    # The two halves around attention, which prefill_graphs.py captures as CUDA graphs of their own.
    def before_attention(self, x, residual, positions, rope, backend, batch):
        """The input norm (adding x to the residual stream) and q, k, v; returns them and the residual stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(h, positions, rope, backend, batch), residual)

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor):
        """o_proj, the post-attention norm and the MLP; returns the layer's output and the residual stream."""
        h, residual = self.post_attention_layernorm(self.self_attn.output(attn), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """The decoder; with a `tp` group of several ranks, this rank's share of it (model/parallel.py)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup()
        self.part = part = Partition.of(cfg, tp.rank, tp.size)
        self.embed_tokens = VocabParallelEmbedding(cfg, part, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, part, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        vocab_rows = self.embed_tokens.num_embeddings
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.lm_head_blocks: BlockLinear | None = None  # set by use_cpu_kernels
        self.decode_layers: DecodeLayers | None = None  # set by use_cpu_kernels: decode steps' layers in one call
        self.lora: LoRAContext | None = None  # set by use_lora

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns float32 logits: one row per request (its last new token), or per new token. `logits_out`: a
        float32 buffer of the right shape to write them to (CUDA graphs share one)."""
        if batch.attn_metadata is None:  # a CUDA graph's batch comes with its metadata
            backend.init_forward_metadata(batch)
        if self.lora is not None:
            self.lora.batch = batch.lora
        x, residual = self.embed_tokens(batch.input_ids), None
        if batch.input_embeds is not None:
            rows, embeds = batch.input_embeds
            x[rows] = embeds.to(x.dtype)
        one_call = self.decode_layers
        if one_call is not None and batch.mode == ForwardMode.DECODE and one_call.applies(self, batch, x.shape[0]):
            x = one_call(self, x, batch, backend.kv_cache)  # every layer and the final norm in one C call
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, batch.positions, self.rope, backend, batch)
            if not batch.return_all_logits and batch.mode != ForwardMode.DECODE:  # decode: every token is a last one
                last = batch.last_token_indices()
                x, residual = x[last], residual[last]
            x, _ = self.norm(x, residual)
        return self.logits(x, logits_out)

    def logits(self, x: torch.Tensor, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of the final-normed hidden states `x` (into `logits_out` when given)."""
        if self.lm_head_blocks is not None:
            logits = self.lm_head_blocks(x)
        else:
            logits = F.linear(x, self.lm_head_weight)
        logits = self.tp.gather_columns(logits, self.cfg.vocab_size)  # every rank's vocabulary columns
        return logits.float() if logits_out is None else logits_out.copy_(logits)

    # --- CPU kernels -----------------------------------------------------------------------------

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Our weights under their HF names (views into the fused parameters)."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight}
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            attn, mlp, pre = layer.self_attn, layer.mlp, f"model.layers.{i}."
            for shard, name in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{pre}self_attn.{name}.weight"] = attn.qkv_proj.weight[self._shard_slice("qkv_proj", shard)]
            out[f"{pre}self_attn.o_proj.weight"] = attn.o_proj.weight
            for shard, name in enumerate(("gate_proj", "up_proj")):
                out[f"{pre}mlp.{name}.weight"] = mlp.gate_up_proj.weight[self._shard_slice("gate_up_proj", shard)]
            out[f"{pre}mlp.down_proj.weight"] = mlp.down_proj.weight
        return out

    def use_cpu_kernels(self, lib, blocks: dict[str, BlockWeight]) -> int:
        """fp32 on a CPU: RMSNorm through the kernel library, and every projection whose weights `blocks` (HF
        names) covers through the block-quantized matmul. Returns how many projections use blocks."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = lib
        swapped = 0

        def swap(owner: nn.Module, attr: str, names: list[str]) -> None:
            nonlocal swapped
            if all(n in blocks for n in names):
                parts = [blocks[n] for n in names]
                if len({p.bits for p in parts}) == 1:
                    linear = getattr(owner, attr)
                    setattr(owner, attr, BlockLinear(linear.weight, linear.bias, BlockWeight.cat(parts), lib))
                    swapped += 1

        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            swap(layer.self_attn, "qkv_proj", [f"{pre}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")])
            swap(layer.self_attn, "o_proj", [f"{pre}self_attn.o_proj.weight"])
            swap(layer.mlp, "gate_up_proj", [f"{pre}mlp.{n}.weight" for n in ("gate_proj", "up_proj")])
            swap(layer.mlp, "down_proj", [f"{pre}mlp.down_proj.weight"])
        head = "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        if head in blocks:
            self.lm_head_blocks = BlockLinear(self.lm_head_weight, None, blocks[head], lib)
            swapped += 1
        if self.embed_tokens.weight.dtype == torch.float32:
            self.decode_layers = DecodeLayers.of(self, lib)
        return swapped

    def use_lora(self, pool: LoRAPool) -> LoRAContext:
        """Wrap every projection that the pool has adapter slots for in a LoRALinear (after use_cpu_kernels: it
        wraps whatever computes the base projection)."""
        self.lora = ctx = LoRAContext()
        for layer, projections in zip(self.layers, pool.layers):
            owners = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
            owners.update(gate_up_proj=layer.mlp, down_proj=layer.mlp)
            for name, proj in projections.items():
                setattr(owners[name], name, LoRALinear(getattr(owners[name], name), proj, ctx))
        return ctx

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
            tensor = self.part.slice_hf(name, tensor)
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    param[self._shard_slice(target, shard)].copy_(tensor)
            loaded.add(f"{target}#{shard}")
        self._check_all_loaded(loaded, fused)

    def _shard_slice(self, target: str, shard: int) -> slice:
        part, head_dim = self.part, self.cfg.head_dim
        if "qkv_proj" in target:
            q, kv = part.num_heads * head_dim, part.num_kv_heads * head_dim
            bounds = [0, q, q + kv, q + 2 * kv]
        else:
            bounds = [0, part.intermediate_size, 2 * part.intermediate_size]
        return slice(bounds[shard], bounds[shard + 1])

    def _text_parameters(self) -> list[str]:
        """The parameters load_weights fills (a vision-language subclass loads its tower's itself)."""
        return list(dict(self.named_parameters()))

    def _check_all_loaded(self, loaded: set[str], fused: dict) -> None:
        missing = []
        for name in self._text_parameters():
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
        """Random weights of realistic scale, for speed runs at real shapes without a checkpoint. Under tensor
        parallelism each rank draws every whole parameter as one device would and keeps its share, so the ranks
        together hold the same weights as a single device with the same seed."""
        device = self.embed_tokens.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        full_shapes = self._full_shapes() if self.tp.size > 1 else {}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name in full_shapes:
                    full = torch.empty(full_shapes[name], dtype=p.dtype, device=device).uniform_(
                        -0.02, 0.02, generator=gen
                    )
                    p.copy_(self.part.slice_fused(name, full, self.cfg))
                else:
                    p.uniform_(-0.02, 0.02, generator=gen)

    def _full_shapes(self) -> dict[str, torch.Size]:
        """Every parameter's shape on a single device (a size-1 twin built on the meta device)."""
        with torch.device("meta"):
            whole = type(self)(self.cfg, 1)
        return {name: p.shape for name, p in whole.named_parameters()}
