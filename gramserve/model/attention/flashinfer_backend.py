"""FlashInfer attention over our KV pool, read as a paged cache with page size 1 (NHD layout, no copies).

Extend (prefill, also over a cached prefix): the new K/V are stored first, then one batched paged-prefill
kernel attends over prefix + new tokens with a bottom-right-aligned causal mask. Decode: the batched paged
decode kernel, on tensor cores when query heads share KV heads (GQA). Decode also runs inside CUDA graphs:
one wrapper per captured batch size over shared static index buffers, re-planned before each replay.
Needs bf16 or fp16 (FlashInfer has no fp32 kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.attention.kv_indices import build_kv_indices
from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.kv_cache import KVCache

WORKSPACE_BYTES = 256 * 2**20
# Zeroed entries past the end of each kv_indices tensor. The SM90 paged-prefill kernel (head_dim 64, page size 1)
# faulted with an illegal memory access under a 1B-shape load of many short prefills; an exactly sized indices tensor
# is the suspect (a kernel that reads ahead a tile past the last index). Slot 0 exists, so a read-ahead is harmless.
KV_INDICES_PAD = 1024


@dataclass
class FlashInferMetadata:
    wrapper: Any  # a planned BatchPrefill/BatchDecode wrapper


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_heads: int):
        super().__init__(kv_cache)
        import flashinfer

        if kv_cache.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                "the flashinfer backend needs --dtype bfloat16 or float16 (use triton or torch for float32)"
            )
        self._fi = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_cache.num_kv_heads, kv_cache.head_dim
        self.scale = self.head_dim**-0.5
        dev = kv_cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # Tensor cores pay off for decode once several query heads read each KV head.
        self.use_tensor_cores = num_heads // self.num_kv_heads >= 2
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._graph_wrappers: dict[int, Any] = {}
        self._plan_copied = torch.cuda.Event()  # recorded after each plan's host-to-device copy was queued

    def _plan_args(self) -> dict:
        dt = self.kv_cache.dtype
        return dict(sm_scale=self.scale, q_data_type=dt, kv_data_type=dt)

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """`wrapper.plan` once the previous plan's copy has run.

        FlashInfer's plan writes its schedule into the wrapper's page-locked buffer and queues a non-blocking
        copy to the GPU. Under the overlap schedule the next batch is planned while the last one is still
        queued; writing the buffer before its copy ran would hand that batch the new schedule. The wait is
        normally free: the copy sits right behind the sampling step the scheduler has already waited for.
        """
        self._plan_copied.synchronize()
        wrapper.plan(*args, **kwargs)
        self._plan_copied.record()

    def _indices(self, batch_rows, seq_lens, indptr_cpu: torch.Tensor, req_to_token) -> torch.Tensor:
        dev = self.kv_cache.device
        out = torch.zeros(int(indptr_cpu[-1]) + KV_INDICES_PAD, dtype=torch.int32, device=dev)
        return build_kv_indices(req_to_token, batch_rows, seq_lens, indptr_cpu.to(dev, non_blocking=True), out)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        bs = batch.batch_size
        kv_indptr = _indptr(batch.seq_lens_cpu)
        kv_indices = self._indices(batch.req_pool_indices, batch.seq_lens, kv_indptr, batch.req_to_token)
        last_page = torch.ones(bs, dtype=torch.int32)
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if batch.mode == ForwardMode.DECODE:
            self._plan(self.decode, kv_indptr, kv_indices, last_page, h, hk, d, 1, **self._plan_args())
            batch.attn_metadata = FlashInferMetadata(self.decode)
        else:
            qo_indptr = _indptr(batch.extend_seq_lens_cpu)
            self._plan(
                self.prefill, qo_indptr, kv_indptr, kv_indices, last_page, h, hk, d, 1, causal=True, **self._plan_args()
            )
            batch.attn_metadata = FlashInferMetadata(self.prefill)

    def forward(self, q, k, v, layer, batch, scale):
        if k is not None:  # None: the model already wrote them (fused RoPE + store)
            self.kv_cache.store(layer, batch.out_cache_loc, k, v)
        paged = (self.kv_cache.k[layer].unsqueeze(1), self.kv_cache.v[layer].unsqueeze(1))  # [slots, 1, Hkv, D]
        out = batch.attn_metadata.wrapper.run(q.contiguous(), paged)
        return out.reshape(q.shape[0], -1)

    # --- CUDA graphs --------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_context: int) -> None:
        dev = self.kv_cache.device
        self._cg_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._cg_last = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self._cg_indices = torch.zeros(max_bs * max_context, dtype=torch.int32, device=dev)

    def cuda_graph_capture_metadata(self, bs, req_pool_indices, seq_lens, req_to_token):
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self._cg_indptr[: bs + 1],
            paged_kv_indices_buffer=self._cg_indices,
            paged_kv_last_page_len_buffer=self._cg_last[:bs],
        )
        self._graph_wrappers[bs] = wrapper
        self.cuda_graph_replay_metadata(bs, req_pool_indices, seq_lens, [1] * bs, req_to_token)
        return FlashInferMetadata(wrapper)

    def cuda_graph_replay_metadata(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, req_to_token):
        kv_indptr = _indptr(seq_lens_cpu)
        kv_indices = self._indices(req_pool_indices, seq_lens, kv_indptr, req_to_token)
        self._plan(
            self._graph_wrappers[bs],
            kv_indptr,
            kv_indices,
            torch.ones(bs, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            **self._plan_args(),
        )
