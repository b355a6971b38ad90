"""Drive a ModelRunner directly with the scheduler's KV bookkeeping: prefill, extend over a shared prefix, decode."""

from __future__ import annotations

import torch

from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.lora.batch import make_lora_batch
from gramserve.model.runner import ModelRunner, RunnerConfig
from gramserve.scheduler.memory import ReqToTokenPool, TokenSlotAllocator

# Small but realistic GQA shapes (head_dim 128, 4 query heads per KV head) and the default model's shapes.
SMALL_GQA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
SMOLLM_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}


def make_runner(
    config_path: str,
    backend: str,
    dtype: str = "bfloat16",
    device: str = "cuda",
    graphs: bool = False,
    max_reqs: int = 256,
    graph_bs: int = 256,
    seed: int = 0,
    kv_gb: float = 1.0,
    lora_slots: int = 0,
    max_lora_rank: int = 16,
    prefill_graph_tokens: int = 0,
    quantization: str = "none",
) -> tuple[ModelRunner, "Harness"]:
    config = RunnerConfig(
        model_path=config_path,
        load_format="dummy",
        device=device,
        dtype=dtype,
        attention_backend=backend,
        kv_cache_memory_gb=kv_gb,
        seed=seed,
        context_length=4096,
        cuda_graph_max_bs=graph_bs if graphs else 0,
        prefill_graph_max_tokens=prefill_graph_tokens,
        max_running_requests=max_reqs,
        lora_slots=lora_slots,
        max_lora_rank=max_lora_rank,
        quantization=quantization,
    )
    runner = ModelRunner(config)
    harness = Harness(runner, max_reqs)
    runner.init_cuda_graphs(harness.pool.table)
    return runner, harness


class Harness:
    def __init__(self, runner: ModelRunner, max_reqs: int):
        self.runner = runner
        self.dev = runner.device
        self.pool = ReqToTokenPool(max_reqs, runner.context_length, runner.device)
        self.reset()

    def reset(self) -> None:
        """Forget every request (the table tensor stays: captured graphs read it)."""
        self.alloc = TokenSlotAllocator(self.runner.kv_cache.num_slots, self.runner.device)
        self.pool.table.zero_()
        self.lens: dict[int, int] = {}  # row -> KV length

    def share_prefix(self, src: int, dst: int, n: int) -> None:
        """Row dst starts with the first n slots of row src (what a prefix-cache hit gives)."""
        self.pool.table[dst, :n] = self.pool.table[src, :n]
        self.lens[dst] = n

    def extend(
        self, rows: list[int], new_ids: list[list[int]], lora: list[int] | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        """`lora`: each row's adapter slot (-1: none), for a runner with a LoRA pool; `all_logits`: a row of logits
        per new token."""
        prefix = [self.lens.get(r, 0) for r in rows]
        slots = self.alloc.alloc(sum(len(i) for i in new_ids))
        locs, positions, off = [], [], 0
        for row, p, ids in zip(rows, prefix, new_ids):
            s = slots[off : off + len(ids)]
            off += len(ids)
            self.pool.write(row, p, s)
            locs.append(s)
            positions.append(torch.arange(p, p + len(ids)))
            self.lens[row] = p + len(ids)
        seq = [self.lens[r] for r in rows]
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            torch.tensor(sum(new_ids, []), device=self.dev),
            torch.cat(positions).to(self.dev),
            torch.cat(locs),
            torch.tensor(rows, device=self.dev),
            torch.tensor(seq, device=self.dev),
            seq,
            prefix,
            [len(i) for i in new_ids],
            self.pool.table,
            return_all_logits=all_logits,
        )
        if lora is not None:
            batch.lora = make_lora_batch(lora, self.dev, [len(i) for i in new_ids])
        return self.runner.forward(batch).clone()

    def decode(self, rows: list[int], tokens: list[int], lora: list[int] | None = None) -> torch.Tensor:
        lens = [self.lens[r] for r in rows]
        slots = self.alloc.alloc(len(rows))
        self.pool.table[torch.tensor(rows, device=self.dev), torch.tensor(lens, device=self.dev)] = slots.to(
            torch.int32
        )
        for r in rows:
            self.lens[r] += 1
        seq = [n + 1 for n in lens]
        batch = ForwardBatch(
            ForwardMode.DECODE,
            torch.tensor(tokens, device=self.dev),
            torch.tensor(lens, device=self.dev),
            slots,
            torch.tensor(rows, device=self.dev),
            torch.tensor(seq, device=self.dev),
            seq,
            lens,
            [1] * len(rows),
            self.pool.table,
        )
        if lora is not None:
            batch.lora = make_lora_batch(lora, self.dev)
        return self.runner.forward(batch).clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
