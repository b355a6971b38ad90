"""CUDA graphs for short prefill (extend) steps: every layer's work outside attention replays a captured graph.

An eager prefill step of a few tokens costs its launches, not its FLOPs: each layer runs five Triton kernels and
four matmuls from Python, about 6.8 ms a step for the 1B shape, where its decode step replays a graph in 1.5-1.9 ms
(docs/benchmarks.md, issue 18 run 20). Under steady traffic new prompts arrive a few at a time, so such steps take
most of a small model's time. Attention cannot be captured once for every mix of prompt and prefix lengths, so the
forward is cut at each attention call ("piecewise" graphs, as in SGLang): piece 0 is the embedding and layer 0 up
to q/k/v, piece i is layer i-1 from o_proj on and layer i up to q/k/v, the last piece ends with the final norm.
Between two pieces the attention backend runs eagerly over the step's real tokens.

Graphs are captured per padded token count (`token_buckets`) over static buffers shared by every size: the
inputs, the residual stream, q (k and v where the backend stores them) and the attention output. Padding rows
write their K/V to scratch slot 0, and every op outside attention treats rows independently, so the real rows'
results do not depend on the padding. The runner also runs the same pieces without graphs (`graphs=False`): the
CPU tests check that path against the plain forward.
"""

from __future__ import annotations

import logging
import time

import torch

from gramserve.model.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts with a graph: steps of at most 1/4 of the size above 64 tokens."""
    sizes = [8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    sizes += list(range(640, 8193, 128))
    out = [s for s in sizes if s <= max_tokens]
    if max_tokens > 0 and (not out or out[-1] != max_tokens):
        out.append(max_tokens)
    return out


class PrefillGraphRunner:
    def __init__(self, model, backend, max_tokens: int, graphs: bool = True):
        self.model, self.backend = model, backend
        self.sizes = token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.use_graphs = graphs
        cfg, attn = model.cfg, model.layers[0].self_attn
        dev, dtype, n = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype, self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.long, device=dev)  # padding rows: scratch slot 0
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)  # after the final norm
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
        self.k = torch.zeros(n, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.kv_stored = True  # whether project() stored k and v itself (learned on the first piece run)
        self.attn = torch.zeros(n, attn.num_heads * attn.head_dim, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_seconds = 0.0

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.mode == ForwardMode.EXTEND
            and batch.input_ids.shape[0] <= self.max_tokens
            and batch.lora is None
            and batch.input_embeds is None
        )

    # --- the pieces ------------------------------------------------------------------------------

    def _static_batch(self, size: int) -> ForwardBatch:
        """What the pieces read of a batch: its tokens, positions and KV slots (the static buffers' rows)."""
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size],
            req_pool_indices=self.input_ids[:0],
            seq_lens=self.input_ids[:0],
            seq_lens_cpu=[],
            extend_prefix_lens_cpu=[],
            extend_seq_lens_cpu=[],
            req_to_token=self.input_ids[:0],
        )

    def _piece(self, index: int, size: int) -> None:
        """Piece `index` over the first `size` rows of the static buffers."""
        model, batch = self.model, self._static_batch(size)
        residual = self.residual[:size]
        if index == 0:
            x, stream = model.embed_tokens(batch.input_ids), None
        else:
            x, stream = model.layers[index - 1].after_attention(self.attn[:size], residual)
        if index == len(model.layers):
            h, stream = model.norm(x, stream)
            self.hidden[:size].copy_(h)
            return
        q, k, v, stream = model.layers[index].before_attention(
            x, stream, batch.positions, model.rope, self.backend, batch
        )
        self.q[:size].copy_(q)
        self.kv_stored = k is None
        if k is not None:
            self.k[:size].copy_(k)
            self.v[:size].copy_(v)
        if stream.data_ptr() != residual.data_ptr():  # the fused add-norm updated it in place; the others did not
            residual.copy_(stream)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        t0 = time.time()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        if self.model.lora is not None:
            self.model.lora.batch = None  # the pieces run no adapter kernels
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            pieces = []
            for index in range(len(self.model.layers) + 1):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._piece(index, size)  # compiles and warms its kernels outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._piece(index, size)
                pieces.append(graph)
            self.graphs[size] = pieces
        torch.cuda.synchronize()
        self.capture_seconds = time.time() - t0
        logger.info(
            "captured prefill CUDA graphs for %d token counts up to %d (%d pieces each) in %.1f s",
            len(self.sizes),
            self.max_tokens,
            len(self.model.layers) + 1,
            self.capture_seconds,
        )

    # --- a step ----------------------------------------------------------------------------------

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The float32 logits of an extend batch, as the model's forward returns them."""
        model, tokens = self.model, batch.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= tokens)
        self.input_ids[:tokens].copy_(batch.input_ids)
        self.positions[:tokens].copy_(batch.positions)
        self.out_cache_loc[:tokens].copy_(batch.out_cache_loc)
        if size > tokens:
            for t in (self.input_ids, self.positions, self.out_cache_loc):
                t[tokens:size].zero_()
        if batch.attn_metadata is None:
            self.backend.init_forward_metadata(batch)
        if model.lora is not None:
            model.lora.batch = None
        pieces = self.graphs.get(size)
        self._run_piece(pieces, 0, size)
        for index, layer in enumerate(model.layers):
            k, v = (None, None) if self.kv_stored else (self.k[:tokens], self.v[:tokens])
            out = layer.self_attn.attend(self.q[:tokens], k, v, self.backend, batch)
            self.attn[:tokens].copy_(out)
            self._run_piece(pieces, index + 1, size)
        if batch.return_all_logits:
            x = self.hidden[:tokens]
        else:
            x = self.hidden[batch.last_token_indices()]
        return model.logits(x)

    def _run_piece(self, pieces: list[torch.cuda.CUDAGraph] | None, index: int, size: int) -> None:
        if pieces is None:
            self._piece(index, size)
        else:
            pieces[index].replay()
