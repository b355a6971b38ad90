"""Attention through our own Triton kernels (`triton_kernels.py`) over the paged KV pool; any float dtype.

Extend and decode read K/V through req_to_token directly (no index flattening). Decode metadata is only
tensors the CUDA graph runner keeps static, plus a split count fixed per batch size, so graphs need no
re-planning before a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.attention.triton_kernels import decode_attention, decode_splits, extend_attention
from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.kv_cache import KVCache


@dataclass
class TritonDecodeMetadata:
    rows: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: int


@dataclass
class TritonExtendMetadata:
    rows: torch.Tensor
    qo_start: torch.Tensor
    prefix_lens: torch.Tensor
    new_lens: torch.Tensor
    max_new: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_heads: int):
        super().__init__(kv_cache)
        self.num_heads = num_heads
        self.num_sms = torch.cuda.get_device_properties(kv_cache.device).multi_processor_count

    def _decode_meta(self, rows, seq_lens, bs: int) -> TritonDecodeMetadata:
        return TritonDecodeMetadata(rows, seq_lens, decode_splits(bs, self.kv_cache.num_kv_heads, self.num_sms))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            batch.attn_metadata = self._decode_meta(batch.req_pool_indices, batch.seq_lens, batch.batch_size)
            return
        new = batch.extend_seq_lens_cpu
        starts = [0]
        for n in new[:-1]:
            starts.append(starts[-1] + n)
        dev = self.kv_cache.device
        ints = torch.tensor([starts, batch.extend_prefix_lens_cpu, new], dtype=torch.int32).to(dev, non_blocking=True)
        batch.attn_metadata = TritonExtendMetadata(batch.req_pool_indices, ints[0], ints[1], ints[2], max(new))

    def forward(self, q, k, v, layer, batch, scale):
        if k is not None:  # None: the model already wrote them (fused RoPE + store)
            self.kv_cache.store(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_cache.k[layer], self.kv_cache.v[layer]
        meta = batch.attn_metadata
        q = q.contiguous()
        out = torch.empty_like(q)
        if batch.mode == ForwardMode.DECODE:
            decode_attention(q, k_buf, v_buf, out, batch.req_to_token, meta.rows, meta.seq_lens, scale, meta.num_splits)
        else:
            extend_attention(
                q,
                k_buf,
                v_buf,
                out,
                batch.req_to_token,
                meta.rows,
                meta.qo_start,
                meta.prefix_lens,
                meta.new_lens,
                meta.max_new,
                scale,
            )
        return out.reshape(q.shape[0], -1)

    # --- CUDA graphs: the static rows / seq_lens tensors are the metadata ----------------------------

    def init_cuda_graph_state(self, max_bs: int, max_context: int) -> None:
        pass

    def cuda_graph_capture_metadata(self, bs, req_pool_indices, seq_lens, req_to_token):
        return self._decode_meta(req_pool_indices, seq_lens, bs)

    def cuda_graph_replay_metadata(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, req_to_token):
        pass
