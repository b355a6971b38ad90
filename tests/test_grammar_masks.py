"""Grammar bitmasks applied to logits: the CPU path of MaskApplier and the CUDA path's Triton kernel, run here
through Triton's interpreter on CPU tensors (tests/gpu/test_grammar_masks.py runs it on a GPU)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_in_triton_interpreter

from gramserve.sampling.bitmask import _torch_apply_bitmask
from gramserve.sampling.grammar_masks import MaskApplier


def reference(logits: torch.Tensor, bitmask: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """logits[row] masked with bitmask[slot] for each (row, slot)."""
    rows, slots = [r for r, _ in pairs], [s for _, s in pairs]
    out = logits.clone()
    sub = out[rows]
    _torch_apply_bitmask(sub, bitmask[slots])
    sub[:, bitmask.shape[1] * 32 :] = float("-inf")  # logits wider than the grammar's vocabulary
    out[rows] = sub
    return out


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


PAIRS = [
    [(i, i) for i in range(6)],  # every row constrained, slots in order
    [(0, 0), (1, 1), (2, 2)],
    [(0, 7), (1, 3), (2, 0)],  # the first rows, other slots
    [(4, 1), (1, 6)],
    [(5, 2)],
]


@pytest.mark.parametrize("pairs", PAIRS)
def test_cpu_applier_matches_the_reference(pairs):
    bitmask = random_bitmask(8, 40, seed=len(pairs))
    logits = torch.randn(6, 40 * 32 + 17)  # 17 columns past the bitmask
    want = reference(logits, bitmask, pairs)
    MaskApplier(bitmask, torch.device("cpu")).apply(logits, pairs)
    assert torch.equal(logits, want)


def word_patterned_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    """Words as grammars write them: mostly all clear or all set, some mixed."""
    g = torch.Generator().manual_seed(seed)
    bitmask = random_bitmask(rows, words, seed)
    kind = torch.randint(0, 3, (rows, words), generator=g)
    bitmask[kind == 0] = 0
    bitmask[kind == 1] = -1
    return bitmask


@pytest.mark.parametrize("vocab", [40 * 32, 40 * 32 + 17, 39 * 32 + 5, 100])
def test_cpu_kernel_matches_the_reference(vocab):
    """The C kernel behind the CPU applier: whole words, mixed words, logits narrower or wider than the bitmask."""
    from gramserve.sampling.bitmask_cpu import apply_pairs

    bitmask = word_patterned_bitmask(8, 40, seed=vocab)
    pairs = [(0, 7), (3, 3), (5, 0), (2, 5)]
    logits = torch.randn(6, vocab)
    want = logits.clone()
    for row, slot in pairs:  # the reference, one row at a time; columns past the bitmask are disallowed
        _torch_apply_bitmask(want[row : row + 1, : min(vocab, 40 * 32)], bitmask[slot : slot + 1])
        want[row, 40 * 32 :] = float("-inf")
    table = torch.tensor(pairs + [(6, 0), (0, 8), (-1, 2)], dtype=torch.int32)  # out of range: skipped
    if not apply_pairs(logits, bitmask, table):
        pytest.skip("the CPU kernel cannot be built here (no compiler or no AVX2)")
    assert torch.equal(logits, want)
    assert not apply_pairs(logits.to(torch.bfloat16), bitmask, table)  # other dtypes take the torch path


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from gramserve.sampling.bitmask_kernel import apply_masks
    from tests.test_grammar_masks import random_bitmask, reference

    for dtype in (torch.float32, torch.bfloat16):
        cases = ((5000, 100, [(3, 6), (0, 0), (4, 2)]), (3200, 100, [(i, i) for i in range(5)]), (4100, 130, [(2, 7)]))
        for vocab, words, pairs in cases:
            bitmask = random_bitmask(8, words, seed=vocab)
            logits = torch.randn(5, vocab).to(dtype)
            want = reference(logits, bitmask, pairs)
            apply_masks(logits, bitmask, torch.tensor(pairs, dtype=torch.int32), covered=min(vocab, words * 32))
            assert torch.equal(logits, want), (dtype, vocab, words, pairs)
    print("ok")
""")


def test_triton_kernel_in_the_interpreter():
    run_in_triton_interpreter(KERNEL_CHECK)
