"""The device pool of LoRA adapters: a fixed number of slots, each able to hold one adapter of rank up to R.

For each layer and each of our fused projections (qkv_proj, o_proj, gate_up_proj, down_proj) that a target module
falls in, the pool holds
- `a` [slots, n * R, in]: the lora_A of each of the projection's n targeted modules, stacked along the rank;
- `b` [slots, rows, R]: their scaled lora_B, stacked along the output rows.
A smaller rank is zero-padded to R, so one matmul serves every adapter. R is rounded up to 16 (the GPU kernel's
smallest matmul tile). The pool is allocated once, before the KV cache is sized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gramserve.model.lora.adapter import LoRAAdapter, module_shapes
from gramserve.model.model_config import ModelConfig

# Our fused projections and the HF modules in each, in output order.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
RANK_ALIGN = 16


@dataclass(frozen=True)
class SubModule:
    """One targeted module inside a fused projection."""

    name: str  # HF name (q_proj, ...)
    out_start: int  # its first output column in the fused projection's output
    out_end: int
    b_start: int  # its first row in the pool's `b`
    index: int  # its place in the stack: its A rows are [index * R, (index + 1) * R)


@dataclass
class ProjectionPool:
    a: torch.Tensor  # [slots, n * R, in]
    b: torch.Tensor  # [slots, rows, R]
    subs: tuple[SubModule, ...]
    rank: int  # R


def pool_rank(max_rank: int) -> int:
    return -(-max_rank // RANK_ALIGN) * RANK_ALIGN


class LoRAPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        target_modules: tuple[str, ...],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots, self.max_rank, self.rank = num_slots, max_rank, pool_rank(max_rank)
        self.target_modules = target_modules
        shapes = module_shapes(cfg)
        r = self.rank
        self.layers: list[dict[str, ProjectionPool]] = []
        for _ in range(cfg.num_layers):
            projections = {}
            for fused, modules in FUSED_PROJECTIONS.items():
                subs, out, rows = [], 0, 0
                for name in modules:
                    fan_in, fan_out = shapes[name]
                    if name in target_modules:
                        subs.append(SubModule(name, out, out + fan_out, rows, len(subs)))
                        rows += fan_out
                    out += fan_out
                if subs:
                    fan_in = shapes[modules[0]][0]
                    a = torch.zeros(num_slots, len(subs) * r, fan_in, dtype=dtype, device=device)
                    b = torch.zeros(num_slots, rows, r, dtype=dtype, device=device)
                    projections[fused] = ProjectionPool(a, b, tuple(subs), r)
            self.layers.append(projections)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for layer in self.layers for p in layer.values())

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for proj in layer.values():
                proj.a[slot].zero_()
                proj.b[slot].zero_()

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot (modules it does not adapt stay zero)."""
        self.clear(slot)
        r = self.rank
        for layer, projections in enumerate(self.layers):
            for proj in projections.values():
                for sub in proj.subs:
                    pair = adapter.weights.get((layer, sub.name))
                    if pair is None:
                        continue
                    a, b = pair
                    k = a.shape[0]
                    proj.a[slot, sub.index * r : sub.index * r + k].copy_(a, non_blocking=True)
                    proj.b[slot, sub.b_start : sub.b_start + b.shape[0], :k].copy_(b, non_blocking=True)
