"""Grammar bitmasks applied to logits: the CPU path of MaskApplier and the CUDA path's Triton kernel, run here
through Triton's interpreter on CPU tensors (tests/gpu/test_grammar_masks.py runs it on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gramserve.grammar.backends.base import _torch_apply_bitmask
from gramserve.sampling.grammar_masks import MaskApplier


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    sub = out[rows]
    _torch_apply_bitmask(sub, bitmask[rows])
    sub[:, bitmask.shape[1] * 32:] = float("-inf")  # logits wider than the grammar's vocabulary
    out[rows] = sub
    return out


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5], [0, 1, 2], [4, 1], [5]])
def test_cpu_applier_matches_the_reference(rows):
    bitmask = random_bitmask(8, 40, seed=len(rows))
    logits = torch.randn(6, 40 * 32 + 17)  # 17 columns past the bitmask
    want = reference(logits, bitmask, rows)
    MaskApplier(bitmask, torch.device("cpu")).apply(logits, rows)
    assert torch.equal(logits, want)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from gramserve.sampling.bitmask_kernel import apply_masks
    from tests.test_grammar_masks import random_bitmask, reference

    for dtype in (torch.float32, torch.bfloat16):
        for vocab, words, rows in ((5000, 100, [3, 0, 4]), (3200, 100, [0, 1, 2, 3, 4]), (4100, 130, [2])):
            bitmask = random_bitmask(5, words, seed=vocab)
            logits = torch.randn(5, vocab).to(dtype)
            want = reference(logits, bitmask, rows)
            masks = torch.cat([torch.tensor(rows, dtype=torch.int32)[:, None], bitmask[rows]], 1).contiguous()
            apply_masks(logits, masks, covered=min(vocab, words * 32))
            assert torch.equal(logits, want), (dtype, vocab, words, rows)
    print("ok")
""")


def test_triton_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    run = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
