"""CUDA graphs for decode: captured once per padded batch size at start-up, replayed with padding.

Static input tensors (token ids, positions, KV slots to write, req_to_token rows, KV lengths, and with LoRA the
adapter segment table: one entry per pool slot, empty ones doing nothing) are shared by all graphs. With LoRA each
size has two graphs: one with the adapters' kernels, and one without for batches that use no adapter; a batch is
copied into their first rows, padding rows write their K/V to scratch slot 0 and attend over one slot. Graphs
share one memory pool and one logits buffer (a buffer per graph, bs x vocab floats each, held 9 GiB for an 8B
model's 45 sizes); a replay's logits stay valid until the next replay.
"""

from __future__ import annotations

import logging
import time

import torch

from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.lora.batch import BLOCK_M, LoRABatch

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16)) + list(range(288, 4097, 32))
    out = [s for s in sizes if s <= max_bs]
    if not out or out[-1] != max_bs:
        out.append(max_bs)
    return out


class CudaGraphRunner:
    def __init__(self, model, backend, req_to_token: torch.Tensor, max_bs: int, lora_slots: int = 0):
        self.model, self.backend, self.req_to_token = model, backend, req_to_token
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = req_to_token.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.long, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=dev)
        # LoRA: segments (start, length, slot), at most one per pool slot; every graph runs the LoRA kernels.
        self.lora_table = torch.zeros(3, lora_slots, dtype=torch.int32, device=dev) if lora_slots else None
        self.logits = torch.empty(n, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, with LoRA)
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.capture_seconds = 0.0
        backend.init_cuda_graph_state(self.max_bs, req_to_token.shape[1])

    def _batch(self, bs: int, meta, lora: bool) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token=self.req_to_token,
            attn_metadata=meta,
            lora=self._lora_batch(bs) if lora else None,
        )

    def _lora_batch(self, bs: int) -> LoRABatch | None:
        if self.lora_table is None:
            return None
        t = self.lora_table
        # Lanes enough for one adapter's segment of the whole batch (those of a smaller segment find no rows).
        return LoRABatch([], t[0], t[1], t[2], m_split=min(-(-bs // BLOCK_M), 8))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.time()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        variants = (True, False) if self.lora_table is not None else (False,)
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            for lora in variants:
                meta = self.backend.cuda_graph_capture_metadata(
                    bs, self.req_pool_indices[:bs], self.seq_lens[:bs], self.req_to_token
                )
                batch = self._batch(bs, meta, lora)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self.model(batch, self.backend)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.model(batch, self.backend, logits_out=self.logits[:bs])
                self.graphs[bs, lora], self.outputs[bs, lora] = graph, out
        torch.cuda.synchronize()
        self.capture_seconds = time.time() - t0
        count, seconds = len(self.graphs), self.capture_seconds
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", count, self.max_bs, seconds)

    def can_run(self, batch: ForwardBatch) -> bool:
        if batch.mode != ForwardMode.DECODE or batch.batch_size > self.max_bs or batch.return_all_logits:
            return False
        if batch.lora is None:
            return True
        return self.lora_table is not None and len(batch.lora.segments) <= self.lora_table.shape[1]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        padded = next(s for s in self.sizes if s >= bs)
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        lora = batch.lora is not None
        if lora:
            self._copy_lora_segments(batch.lora)
        seq_lens_cpu = batch.seq_lens_cpu
        if padded > bs:
            for t in (self.input_ids, self.positions, self.out_cache_loc, self.req_pool_indices):
                t[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)
            seq_lens_cpu = seq_lens_cpu + [1] * (padded - bs)
        self.backend.cuda_graph_replay_metadata(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded], seq_lens_cpu, self.req_to_token
        )
        self.graphs[padded, lora].replay()
        return self.outputs[padded, lora][:bs]

    def _copy_lora_segments(self, lora: LoRABatch) -> None:
        segments = lora.segments
        table = torch.zeros(3, self.lora_table.shape[1], dtype=torch.int32)
        if segments:
            table[:, : len(segments)] = torch.tensor(segments, dtype=torch.int32).t()
        self.lora_table.copy_(table, non_blocking=True)
