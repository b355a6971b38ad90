"""MaskApplier on a GPU: the Triton kernel masks the right logits rows, and its page-locked staging ring
never hands the GPU a buffer that the host has refilled before the copy ran."""

from __future__ import annotations

import torch

from gramserve.sampling.grammar_masks import RING, MaskApplier
from tests.test_grammar_masks import random_bitmask, reference


def test_cuda_applier_matches_the_reference_while_the_gpu_is_busy():
    dev = torch.device("cuda")
    words, vocab = 1536, 128256  # the default tokenizer's bitmask under a Llama-3 logits width
    shared = torch.zeros(64, words, dtype=torch.int32)  # stands in for the grammar process's shared memory
    applier = MaskApplier(shared, dev)
    busy = torch.randn(4096, 4096, device=dev)
    cases = [list(range(64)), list(range(7)), [5, 63, 0, 17], [40]] * (RING + 1)
    pending = []
    for step, rows in enumerate(cases):  # no synchronization until the end: every copy is queued behind work
        fresh = random_bitmask(64, words, seed=step)
        shared.copy_(fresh)  # the grammar process's fill for this step
        for _ in range(10):
            busy = busy @ busy / 64  # GPU work queued ahead of the copy, as a forward would be
        dtype = torch.float32 if step % 2 else torch.bfloat16
        host = torch.randn(64, vocab).to(dtype)
        logits = host.pin_memory().to(dev, non_blocking=True)  # no sync: the copies stay queued
        applier.apply(logits, rows)
        pending.append((logits, reference(host, fresh, rows), rows))
    for step, (logits, want, rows) in enumerate(pending):
        assert torch.equal(logits.cpu(), want), (step, rows)
