"""LoRALinear: a projection whose output gains, row by row, the share of that row's adapter (if any)."""

from __future__ import annotations

import torch
from torch import nn

from gramserve.model.lora.batch import LoRABatch
from gramserve.model.lora.compute import add_lora
from gramserve.model.lora.pool import ProjectionPool


class LoRAContext:
    """The current forward's LoRA segments, shared by every LoRALinear of a model (None: no adapter rows)."""

    def __init__(self):
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, proj: ProjectionPool, ctx: LoRAContext):
        super().__init__()
        self.base, self.proj, self.ctx = base, proj, ctx

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.ctx.batch
        if batch is not None:
            add_lora(y, x, self.proj, batch)
        return y
