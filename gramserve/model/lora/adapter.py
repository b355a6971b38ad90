"""A LoRA adapter in PEFT's format, read and checked against the model it is for.

A PEFT adapter folder holds `adapter_config.json` and `adapter_model.safetensors` (or the older
`adapter_model.bin`). Each adapted projection has lora_A [r, in] and lora_B [out, r]; its output gains
scaling * B(A(x)), scaling = alpha / r, or alpha / sqrt(r) with rsLoRA. `rank_pattern` / `alpha_pattern`
give modules their own r and alpha. The scaling is folded into B once here.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from gramserve.config import LORA_TARGET_MODULES as TARGET_MODULES  # the projections LoRA may adapt (HF names)
from gramserve.host_memory import available_memory_bytes
from gramserve.model.model_config import ModelConfig

_WEIGHT_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
MEMORY_MARGIN_BYTES = 1 << 30  # host memory kept free when an adapter loads


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; `status`: 400 for a bad adapter, 404 for a path that does not exist."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of adapter_config.json that decide the weights' scaling."""

    rank: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    base_model: str | None = None

    def scaling(self, module_path: str, rank: int) -> float:
        alpha = float(_pattern_value(self.alpha_pattern, module_path, self.alpha))
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rank/alpha pattern lookup: a key matches a module whose dotted path ends with it (or matches it as a
    regular expression)."""
    for key, value in patterns.items():
        if module_path == key or module_path.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module_path):
            return value
    return default


def read_adapter_config(path: str) -> AdapterConfig:
    """Check a PEFT adapter folder's config (cheap: no weights read)."""
    if not path or not os.path.exists(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} does not exist", status=404)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a folder (PEFT's adapter_config.json + weights)")
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(f"no adapter_config.json in LoRA adapter path {path!r}") from None
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"cannot read {config_file}: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError("adapter_config.json is not a JSON object")
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"peft_type {raw.get('peft_type')!r} is not supported; only LORA adapters are")
    unsupported = [
        ("use_dora", raw.get("use_dora")),
        ("modules_to_save", raw.get("modules_to_save")),
        ("fan_in_fan_out", raw.get("fan_in_fan_out")),
        ("layer_replication", raw.get("layer_replication")),
    ]
    for key, value in unsupported:
        if value:
            raise LoRAAdapterError(f"adapter_config.json sets {key}={value!r}, which gramserve does not serve")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError(f"adapter_config.json sets bias={raw['bias']!r}; only bias 'none' is served")
    try:
        rank, alpha = int(raw.get("r", 8)), float(raw.get("lora_alpha", 8))
    except (TypeError, ValueError):
        raise LoRAAdapterError("adapter_config.json: r and lora_alpha must be numbers") from None
    if rank < 1:
        raise LoRAAdapterError(f"adapter_config.json: r must be at least 1, got {rank}")
    return AdapterConfig(
        rank=rank,
        alpha=alpha,
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=dict(raw.get("rank_pattern") or {}),
        alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        base_model=raw.get("base_model_name_or_path"),
    )


def module_path(layer: int, module: str) -> str:
    """A target's dotted path in an HF Llama-family model (PEFT's weight names and patterns use it)."""
    parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{parent}.{module}"


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: (layer, module) -> (A [r, in], scaling * B [out, r])."""

    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except Exception as exc:  # noqa: BLE001 - a corrupt file is the adapter's fault
            raise LoRAAdapterError(f"cannot read {st}: {exc}") from None
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.exists(pt):
        try:
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise LoRAAdapterError(f"cannot read {pt}: {exc}") from None
        if not isinstance(tensors, dict):
            raise LoRAAdapterError(f"{pt} does not hold a state dict")
        return tensors
    raise LoRAAdapterError(f"no adapter_model.safetensors (or adapter_model.bin) in LoRA adapter path {path!r}")


def load_adapter(
    path: str,
    model: ModelConfig,
    max_rank: int,
    target_modules: tuple[str, ...] = TARGET_MODULES,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read and check a PEFT adapter for `model`: every tensor a LoRA weight of a known layer and target, of the
    model's shape, rank at most `max_rank`, and room for it in host memory."""
    config = read_adapter_config(path)
    st = os.path.join(path, "adapter_model.safetensors")
    size = os.path.getsize(st) if os.path.exists(st) else 0
    free = available_memory_bytes()
    if free is not None and size * 2 > free - MEMORY_MARGIN_BYTES:
        raise LoRAAdapterError(
            f"loading this adapter ({size / 2**20:.0f} MiB) would exceed the host memory available "
            f"({free / 2**20:.0f} MiB)"
        )
    shapes = module_shapes(model)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        m = _WEIGHT_NAME.search(name)
        if m is None:
            raise LoRAAdapterError(
                f"unsupported tensor {name!r} in the adapter: gramserve serves LoRA weights of "
                f"{', '.join(TARGET_MODULES)} only"
            )
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAAdapterError(f"the adapter adapts {module!r}; LoRA is served on {', '.join(TARGET_MODULES)}")
        if module not in target_modules:
            raise LoRAAdapterError(
                f"the adapter adapts {module!r}, which this server's --lora-target-modules leaves out "
                f"({', '.join(target_modules)})"
            )
        if layer >= model.num_layers:
            raise LoRAAdapterError(f"the adapter has weights for layer {layer}; the model has {model.num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAAdapterError("the adapter holds no LoRA weights")
    weights, top_rank = {}, 0
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise LoRAAdapterError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model "
                f"(expected [r, {fan_in}] and [{fan_out}, r]); is the adapter for another base model"
                + (f" ({config.base_model})?" if config.base_model else "?")
            )
        declared = _pattern_value(config.rank_pattern, module_path(layer, module), config.rank)
        if declared != rank:  # PEFT refuses such an adapter (its scaling is alpha / r)
            raise LoRAAdapterError(
                f"layer {layer} {module}: the weights have rank {rank}, but adapter_config.json gives r={declared}"
            )
        if rank > max_rank:
            raise LoRAAdapterError(
                f"the adapter's rank {rank} (layer {layer} {module}) is above this server's --max-lora-rank {max_rank}"
            )
        scaling = config.scaling(module_path(layer, module), rank)
        a, b = a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(
                f"layer {layer} {module}: the adapter's weights hold NaN or infinite values (once scaled, in {dtype})"
            )
        weights[(layer, module)] = (a, b)
        top_rank = max(top_rank, rank)
    return LoRAAdapter(path=path, rank=top_rank, weights=weights)
