"""Random LoRA adapters in PEFT's format for any model config (no `peft` needed): for speed runs at real shapes.

python benchmarks/lora_adapters.py --config ../shared/models/llama-3.1-8b.json --out /tmp/adapters -n 16 -r 16
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from gramserve.config import LORA_TARGET_MODULES as TARGETS
from gramserve.model.lora.adapter import module_path, module_shapes
from gramserve.model.model_config import ModelConfig


def write_random_adapter(
    config: dict, out_dir: str, rank: int, seed: int, targets=TARGETS, alpha: float | None = None
) -> str:
    """An adapter of small random weights (bf16) on every layer's `targets`."""
    gen = torch.Generator().manual_seed(seed)
    dims = module_shapes(ModelConfig.from_dict(config))
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = dims[module]
            prefix = f"base_model.model.{module_path(layer, module)}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=1)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the model's config.json")
    p.add_argument("--out", required=True, help="folder for the adapters (one subfolder each)")
    p.add_argument("-n", type=int, default=4, help="how many adapters")
    p.add_argument("-r", "--rank", type=int, default=16)
    args = p.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    for i in range(args.n):
        print(write_random_adapter(config, os.path.join(args.out, f"lora{i}"), args.rank, seed=i))


if __name__ == "__main__":
    main()
