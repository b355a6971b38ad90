"""Our model runner against HF transformers on the same weights (fp32): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.runner import ModelRunner, RunnerConfig
from gramserve.scheduler.memory import ReqToTokenPool, TokenSlotAllocator

PROMPTS = [
    "Hello, my name is",
    "The capital of France is a city that",
    "def fib(n):\n    if n < 2:\n        return n\n    ",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "Once upon a time, in a land far, far away, there lived a dragon who loved to read books about",
]


class Harness:
    """Drives the runner directly, with the scheduler's KV bookkeeping."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.alloc = TokenSlotAllocator(runner.kv_cache.num_slots, runner.device)
        self.pool = ReqToTokenPool(16, runner.context_length, runner.device)

    def extend(
        self,
        rows: list[int],
        prefix_lens: list[int],
        new_ids: list[list[int]],
        all_logits: bool = False,
        input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        locs, positions = [], []
        for row, prefix, ids in zip(rows, prefix_lens, new_ids):
            slots = self.alloc.alloc(len(ids))
            self.pool.write(row, prefix, slots)
            locs.append(slots)
            positions.append(torch.arange(prefix, prefix + len(ids)))
        dev = self.runner.device
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            torch.tensor(sum(new_ids, []), device=dev),
            torch.cat(positions).to(dev),
            torch.cat(locs),
            torch.tensor(rows, device=dev),
            torch.tensor([p + len(i) for p, i in zip(prefix_lens, new_ids)], device=dev),
            [p + len(i) for p, i in zip(prefix_lens, new_ids)],
            prefix_lens,
            [len(i) for i in new_ids],
            self.pool.table,
            return_all_logits=all_logits,
            input_embeds=input_embeds,
        )
        return self.runner.forward(batch)

    def decode(self, rows: list[int], lens: list[int], tokens: list[int]) -> torch.Tensor:
        slots = self.alloc.alloc(len(rows))
        for i, row in enumerate(rows):
            self.pool.write(row, lens[i], slots[i : i + 1])
        batch = ForwardBatch(
            ForwardMode.DECODE,
            torch.tensor(tokens),
            torch.tensor(lens),
            slots,
            torch.tensor(rows),
            torch.tensor([n + 1 for n in lens]),
            [n + 1 for n in lens],
            lens,
            [1] * len(rows),
            self.pool.table,
        )
        return self.runner.forward(batch)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(RunnerConfig(kv_cache_memory_gb=0.25, max_running_requests=16))


@pytest.fixture(scope="module")
def hf(runner):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(runner):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(runner.model_dir)


@torch.inference_mode()
def test_batched_prefill_logits_match_hf(runner, hf, tok):
    ids = [tok.encode(p) for p in PROMPTS]
    assert len({len(x) for x in ids}) > 3, "prompts of mixed lengths"
    h = Harness(runner)
    rows = [h.pool.alloc() for _ in ids]
    logits = h.extend(rows, [0] * len(ids), ids, all_logits=True)
    start = 0
    for x in ids:
        ref = hf(torch.tensor([x])).logits[0]
        ours = logits[start : start + len(x)]
        start += len(x)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_extend_over_cached_prefix_matches_full_prefill(runner, hf, tok):
    ids = [tok.encode(p) for p in PROMPTS]
    h = Harness(runner)
    rows = [h.pool.alloc() for _ in ids]
    cut = [len(x) // 2 for x in ids]
    h.extend(rows, [0] * len(ids), [x[:c] for x, c in zip(ids, cut)])  # cache the first halves
    logits = h.extend(rows, cut, [x[c:] for x, c in zip(ids, cut)])  # extend with the rest
    for i, x in enumerate(ids):
        ref = hf(torch.tensor([x])).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_batched_greedy_decode_matches_hf_generate(runner, hf, tok):
    ids = [tok.encode(p) for p in PROMPTS]
    h = Harness(runner)
    rows = [h.pool.alloc() for _ in ids]
    logits = h.extend(rows, [0] * len(ids), ids)
    outs = [[int(t)] for t in logits.argmax(-1)]
    lens = [len(x) for x in ids]
    for _ in range(31):
        logits = h.decode(rows, lens, [o[-1] for o in outs])
        lens = [n + 1 for n in lens]
        for o, t in zip(outs, logits.argmax(-1).tolist()):
            o.append(t)
    for x, ours in zip(ids, outs):
        ref = hf.generate(
            torch.tensor([x]),
            attention_mask=torch.ones(1, len(x), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
        )[0, len(x) :].tolist()
        assert ours == ref, (tok.decode(ours), tok.decode(ref))
