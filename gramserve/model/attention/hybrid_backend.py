"""Two backends over one KV pool: one for extend (prefill) batches, another for decode batches.

`auto` on CUDA uses FlashInfer for prefill (about twice our Triton extend kernel's FLOP rate) and our Triton
kernels for decode (as fast at large batches, faster at batch 1, and no per-step planning before a CUDA
graph replay).
"""

from __future__ import annotations

from gramserve.model.attention.base import AttentionBackend
from gramserve.model.forward_batch import ForwardMode


class HybridAttentionBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        super().__init__(prefill.kv_cache)
        self.prefill, self.decode = prefill, decode
        self.name = f"{prefill.name}_{decode.name}"
        self.supports_cuda_graph = decode.supports_cuda_graph

    def _pick(self, batch) -> AttentionBackend:
        return self.decode if batch.mode == ForwardMode.DECODE else self.prefill

    def init_forward_metadata(self, batch) -> None:
        self._pick(batch).init_forward_metadata(batch)

    def forward(self, q, k, v, layer, batch, scale):
        return self._pick(batch).forward(q, k, v, layer, batch, scale)

    def init_cuda_graph_state(self, max_bs: int, max_context: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_context)

    def cuda_graph_capture_metadata(self, bs, req_pool_indices, seq_lens, req_to_token):
        return self.decode.cuda_graph_capture_metadata(bs, req_pool_indices, seq_lens, req_to_token)

    def cuda_graph_replay_metadata(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, req_to_token):
        self.decode.cuda_graph_replay_metadata(bs, req_pool_indices, seq_lens, seq_lens_cpu, req_to_token)
