"""A decode step's decoder layers in one call into the CPU kernel library (`gs_decode_layers`).

On a CPU with the kernel library, each decoder layer of a decode step is a dozen small kernel calls from Python
(module calls, ctypes, output tensors): about 7 ms a step for the default model on two cores, 40% of a
one-request step. `DecodeLayers` hands the whole stack of layers to C at once. It runs the same kernels in the same
order on the same inputs, so the hidden states are the same bit for bit as the per-layer path's.

It applies to plain decode batches of up to `BlockLinear.max_rows` rows when every layer's projections are
block-quantized (`LlamaForCausalLM.use_cpu_kernels`), without biases, q/k norms, tensor parallelism or LoRA;
other batches take the per-layer path.
"""

from __future__ import annotations

import ctypes

import torch

from gramserve.model import cpu_kernels
from gramserve.model.block_linear import BlockLinear


class _QMat(ctypes.Structure):
    _fields_ = [
        ("bits", ctypes.c_int),
        ("N", ctypes.c_int),
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("ln1", ctypes.c_void_p),
        ("ln2", ctypes.c_void_p),
        ("qkv", _QMat),
        ("o", _QMat),
        ("gate_up", _QMat),
        ("down", _QMat),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


def _qmat(linear: BlockLinear) -> _QMat:
    b = linear.blocks
    m = None if b.m is None else b.m.data_ptr()
    return _QMat(b.bits, linear.weight.shape[0], b.qs.data_ptr(), b.d.data_ptr(), m)


class DecodeLayers:
    """The model's decoder layers as one `gs_decode_layers` call (build with `of`, which returns None where the
    model does not qualify). The model owns it and passes itself to each call: holding the model here would make a
    reference cycle, and a cycle keeps a dropped model's memory until the garbage collector's rare full pass."""

    def __init__(self, model, lib: ctypes.CDLL):
        cfg = model.cfg
        self.lib = lib
        attn = model.layers[0].self_attn
        self.hq, self.hkv, self.dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = cfg.hidden_size
        self.inter = model.layers[0].mlp.down_proj.weight.shape[1]
        self.eps, self.scale = float(cfg.rms_norm_eps), float(attn.scale)
        self.max_rows = min(
            p.max_rows
            for layer in model.layers
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        )
        self._layers = None
        self._kv_cache = None  # the cache the structs point into (held, so its memory cannot be reused meanwhile)

    @classmethod
    def of(cls, model, lib: ctypes.CDLL | None) -> DecodeLayers | None:
        if lib is None or model.tp.size > 1 or not len(model.layers):
            return None
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            projections = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if a.q_norm is not None or not all(isinstance(p, BlockLinear) and p.bias is None for p in projections):
                return None
        return cls(model, lib)

    def applies(self, model, batch, rows: int) -> bool:
        """Whether this batch may take the one-call path: a decode batch whose attention reads the slots itself."""
        return (
            batch.attn_metadata == "slots"
            and 0 < rows <= self.max_rows
            and model.lora is None
            and batch.input_embeds is None
        )

    def _structs(self, model, kv_cache) -> ctypes.Array:
        if self._layers is None or kv_cache is not self._kv_cache:
            layers = (_Layer * len(model.layers))()
            for i, layer in enumerate(model.layers):
                a, mlp = layer.self_attn, layer.mlp
                layers[i] = _Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    _qmat(a.qkv_proj),
                    _qmat(a.o_proj),
                    _qmat(mlp.gate_up_proj),
                    _qmat(mlp.down_proj),
                    kv_cache.k[i].data_ptr(),
                    kv_cache.v[i].data_ptr(),
                )
            self._layers, self._kv_cache = layers, kv_cache
        return self._layers

    def __call__(self, model, x: torch.Tensor, batch, kv_cache) -> torch.Tensor:
        """x [M, H] float32 (the embeddings; overwritten) -> the final norm's output [M, H]."""
        m, h, hq, hkv, dim, inter = x.shape[0], self.hidden, self.hq, self.hkv, self.dim, self.inter
        work = torch.empty(m * (3 * h + (hq + 2 * hkv) * dim + 2 * hq * dim + 3 * inter), dtype=torch.float32)
        out = torch.empty((m, h), dtype=torch.float32)
        rope, table = model.rope, batch.req_to_token
        positions = batch.positions.to(torch.int64).contiguous()
        loc = batch.out_cache_loc.to(torch.int64).contiguous()
        rows = batch.req_pool_indices.to(torch.int64).contiguous()
        lens = batch.seq_lens.to(torch.int64).contiguous()
        rc = self.lib.gs_decode_layers(
            self._structs(model, kv_cache), len(model.layers), m, h, hq, hkv, dim, inter, self.eps, self.scale,
            model.norm.weight.data_ptr(), x.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(),
            positions.data_ptr(), loc.data_ptr(), table.data_ptr(), table.stride(0), rows.data_ptr(),
            lens.data_ptr(), work.data_ptr(), out.data_ptr(), cpu_kernels.threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"gs_decode_layers failed ({rc})")
        return out
