"""A linear layer that also holds its weight in blocks (`quant_weights.BlockWeight`) for the CPU decode kernel.

Batches of up to `max_rows` tokens (decode) read the blocks: 4.5-8.5 bits a weight instead of 32, and a decode
step on a CPU is bound by the bytes of weights it reads. Larger batches (prefill) use the float weight and
torch's GEMM, which is faster once the weights are reused across many rows.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from gramserve.model import cpu_kernels
from gramserve.model.quant_weights import BlockWeight

# Measured on a 2-core AVX2 machine (lm_head, 49152 x 576): the kernel wins up to a few dozen rows.
DEFAULT_MAX_ROWS = 32


class BlockLinear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        blocks: BlockWeight,
        lib: ctypes.CDLL,
        max_rows: int = DEFAULT_MAX_ROWS,
    ):
        super().__init__()
        if blocks.shape != tuple(weight.shape):
            raise ValueError(f"blocks {blocks.shape} do not match the weight {tuple(weight.shape)}")
        self.weight, self.bias = weight, bias
        self.blocks, self.lib, self.max_rows = blocks, lib, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows and x.dtype == torch.float32 and not x.is_cuda:
            b = self.blocks
            y = cpu_kernels.qgemm(self.lib, x.contiguous(), b.bits, b.qs, b.d, b.m, self.weight.shape[0],
                                  cpu_kernels.threads())  # fmt: skip
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)
