"""LoRALinear: a projection whose output gains, row by row, the share of that row's adapter (if any)."""

from __future__ import annotations

import torch
from torch import nn

from gramserve.model.lora.batch import LoRABatch
from gramserve.model.lora.compute import add_lora_torch
from gramserve.model.lora.pool import ProjectionPool


class LoRAContext:
    """The current forward's LoRA segments, shared by every LoRALinear of a model (None: no adapter rows), and the
    CUDA side stream the shrinks run on."""

    def __init__(self):
        self.batch: LoRABatch | None = None
        self._side: torch.cuda.Stream | None = None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device=device)
        return self._side


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
        batch = self.ctx.batch
        if batch is None:
            return self.base(x)
        if not x.is_cuda:
            y = self.base(x)
            add_lora_torch(y, x, self.proj, batch)
            return y
        from gramserve.model.lora import triton_ops

        # Both kernels need only x, so on a side stream they run beside the base matmul (inside CUDA graphs too,
        # where the fork and join become parallel branches): for decode-size batches the expand writes its own
        # buffer, added to y once both are done; for larger ones (prefill) it adds into y after the join.
        main, side = torch.cuda.current_stream(x.device), self.ctx.side_stream(x.device)
        decode = x.shape[0] <= triton_ops.SPLIT_K_MAX_ROWS
        side.wait_stream(main)
        with torch.cuda.stream(side):
            partial = triton_ops.shrink(x, self.proj, batch)
            if decode:
                share = torch.zeros(x.shape[0], self.weight.shape[0], dtype=x.dtype, device=x.device)
                triton_ops.expand(share, partial, self.proj, batch)
        y = self.base(x)
        main.wait_stream(side)
        if decode:
            share.record_stream(main)
            return y.add_(share)
        partial.record_stream(main)
        triton_ops.expand(y, partial, self.proj, batch)
        return y
