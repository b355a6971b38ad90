"""Attention in plain torch (SDPA), for the CPU and as the GPU reference.

Decode batches gather every request's KV into one padded tensor and attend in one call; in float32 on a CPU
with the kernel library (`use_cpu_kernels`), they attend straight over the slots instead (no gather).
Extend batches attend request by request, with a causal mask offset by the cached prefix; with the kernel library,
their one-token rows after a prefix (running requests decoding inside a prefill step) go through the decode kernel
together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.forward_batch import ForwardBatch, ForwardMode


@dataclass
class DecodeMetadata:
    kv_indices: torch.Tensor  # [B, L] slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] True where attended


@dataclass
class ExtendMetadata:
    kv_indices: list[torch.Tensor]  # per request: [prefix + new] slots
    masks: list[torch.Tensor | None]  # per request: [new, prefix + new], None when no prefix (plain causal)
    starts: list[int]  # offset of each request's new tokens in the batch
    # The decode kernel's rows (with the kernel library): batch offsets of one-token rows after a prefix, their
    # slot-table rows and KV lengths; their `kv_indices` entries are None.
    single: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class TorchAttentionBackend(AttentionBackend):
    kernels = None  # the CPU kernel library, for float32 decode

    def use_cpu_kernels(self, lib) -> None:
        if self.kv_cache.dtype == torch.float32 and self.kv_cache.device.type == "cpu":
            self.kernels = lib

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token
        device = batch.input_ids.device
        if batch.mode == ForwardMode.DECODE and self.kernels is not None:
            batch.attn_metadata = "slots"  # the kernel reads req_to_token itself
            return
        if batch.mode == ForwardMode.DECODE:
            max_len = max(batch.seq_lens_cpu)
            rows = table[batch.req_pool_indices, :max_len].long()
            mask = torch.arange(max_len, device=device)[None, :] < batch.seq_lens[:, None]
            rows = torch.where(mask, rows, torch.zeros_like(rows))
            batch.attn_metadata = DecodeMetadata(rows, mask[:, None, None, :])
            return
        indices, masks, starts, single = [], [], [], []
        start = 0
        pool_rows = batch.req_pool_indices.tolist()
        for row, prefix, new in zip(pool_rows, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
            total = prefix + new
            starts.append(start)
            start += new
            if new == 1 and prefix > 0 and self.kernels is not None:
                single.append((starts[-1], row, total))
                indices.append(None)
                masks.append(None)
                continue
            indices.append(table[row, :total].long())
            if prefix == 0:
                masks.append(None)
            else:
                q_pos = torch.arange(prefix, total, device=device)[:, None]
                masks.append(torch.arange(total, device=device)[None, :] <= q_pos)
        batch.attn_metadata = ExtendMetadata(indices, masks, starts)
        if single:
            batch.attn_metadata.single = tuple(torch.tensor(col, device=device) for col in zip(*single))

    def forward(self, q, k, v, layer, batch, scale):
        if k is not None:  # None: the model already wrote them (fused RoPE + store)
            self.kv_cache.store(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_cache.k[layer], self.kv_cache.v[layer]
        meta = batch.attn_metadata
        if batch.mode == ForwardMode.DECODE and self.kernels is not None:
            from gramserve.model import cpu_kernels

            return cpu_kernels.decode_attention(self.kernels, q.contiguous(), k_buf, v_buf, batch.req_to_token,
                                                batch.req_pool_indices, batch.seq_lens, scale,
                                                cpu_kernels.threads())  # fmt: skip
        if batch.mode == ForwardMode.DECODE:
            keys = k_buf[meta.kv_indices].transpose(1, 2)  # [B, Hkv, L, D]
            values = v_buf[meta.kv_indices].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True
            )  # [B, Hq, 1, D]
            return out.reshape(q.shape[0], -1)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if meta.single is not None:
            from gramserve.model import cpu_kernels

            at, rows, lens = meta.single
            out[at] = cpu_kernels.decode_attention(self.kernels, q[at].contiguous(), k_buf, v_buf, batch.req_to_token,
                                                   rows, lens, scale, cpu_kernels.threads())  # fmt: skip
        for idx, mask, start, new in zip(meta.kv_indices, meta.masks, meta.starts, batch.extend_seq_lens_cpu):
            if idx is None:  # a decode-kernel row, done above
                continue
            qi = q[start : start + new].transpose(0, 1).unsqueeze(0)  # [1, Hq, new, D]
            ki = k_buf[idx].transpose(0, 1).unsqueeze(0)
            vi = v_buf[idx].transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            out[start : start + new] = oi[0].transpose(0, 1).reshape(new, -1)
        return out
