"""MaskApplier on a GPU: the Triton kernel masks the right logits rows from the right slots, with every copy
queued behind GPU work (no synchronization until the end), through the page-locked shared bitmask and through
the staging fallback."""

from __future__ import annotations

import pytest
import torch

from gramserve.grammar.grammar_shm import page_lock, page_unlock
from gramserve.sampling.grammar_masks import MaskApplier
from tests.test_grammar_masks import random_bitmask, reference

WORDS, VOCAB = 1536, 128256  # the default tokenizer's bitmask under a Llama-3 logits width
SLOTS = 256
# Each step's (logits row, slot) pairs; a step's slots are not rewritten later (the grammar worker only
# refills a slot after the step that read it has sampled, which these queued steps never wait for).
_STEADY = [(i, 200 + i) for i in range(50)]  # passed twice in a row (steady decode): its pairs are not copied again
STEPS = [
    [(i, i) for i in range(64)],
    [(i, 64 + (i * 7) % 7) for i in range(7)],
    [(5, 80), (63, 81), (0, 82)],
    _STEADY,
    _STEADY,
    [(40, 100)],
    [(i, 128 + 2 * i) for i in range(64)],
]
_SHARED = torch.zeros(SLOTS, WORDS, dtype=torch.int32)  # stands in for the grammar worker's shared memory


@pytest.mark.parametrize("staged", [False, True])
def test_cuda_applier_matches_the_reference_while_the_gpu_is_busy(staged):
    dev = torch.device("cuda")
    _SHARED.copy_(random_bitmask(SLOTS, WORDS, seed=int(staged)))
    if not staged:
        assert page_lock(_SHARED)
    applier = MaskApplier(_SHARED, dev, pinned=not staged)
    busy = torch.randn(4096, 4096, device=dev)
    pending = []
    for step, pairs in enumerate(STEPS):
        for _ in range(10):
            busy = busy @ busy / 64  # GPU work queued ahead of the copy, as a forward would be
        dtype = torch.float32 if step % 2 else torch.bfloat16
        host = torch.randn(64, VOCAB).to(dtype)
        logits = host.pin_memory().to(dev, non_blocking=True)  # no sync: the copies stay queued
        applier.apply(logits, pairs)
        pending.append((logits, reference(host, _SHARED, pairs), pairs))
    for step, (logits, want, pairs) in enumerate(pending):
        assert torch.equal(logits.cpu(), want), (step, pairs)
    if not staged:
        page_unlock(_SHARED)
