"""LLaVA (1.5-style): a CLIP vision tower and a two-layer projector in front of one of our decoders.

An image becomes `tokens_per_image` embeddings of the text model's width (`encode_images`); the prompt holds as many
image placeholder tokens, whose embeddings the forward replaces (ForwardBatch.input_embeds). The decoder itself is
LlamaForCausalLM's, unchanged: the KV cache, attention backends, CUDA graphs and LoRA work as for text.

Weights: HF's names from either transformers layout (`language_model.model.layers...` with
`vision_tower.vision_model...`, or transformers 5's `model.language_model...` / `vision_tower.embeddings...`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from gramserve.model.clip_vision import CLIPVisionTower, activation
from gramserve.model.llama import LlamaForCausalLM
from gramserve.model.model_config import ModelConfig, UnsupportedModelError

VISION_PREFIXES = ("vision_tower.", "projector.")


class Projector(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.linear_1 = nn.Linear(v.hidden_size, cfg.hidden_size, bias=v.projector_bias)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=v.projector_bias)
        self.act = activation(v.projector_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp=None):
        super().__init__(cfg, max_positions, tp)  # tp: always a size-1 group (the runner refuses more)
        assert cfg.vision is not None
        self.vision_tower = CLIPVisionTower(cfg.vision)
        self.projector = Projector(cfg)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] normalised pixels -> [N, tokens_per_image, hidden] prompt embeddings."""
        return self.projector(self.vision_tower(pixels))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        vision_loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                ours = hf_to_ours(name)
                if ours is None:
                    continue  # CLIP layers past the feature layer, its post-layernorm
                if ours.startswith(VISION_PREFIXES):
                    parts = ours.split(".")
                    if parts[1] == "layers" and int(parts[2]) >= len(self.vision_tower.layers):
                        continue  # past the feature layer: never run
                    if ours not in params:
                        raise UnsupportedModelError(f"unexpected weight {name!r} for {self.cfg.architecture}")
                    with torch.no_grad():
                        params[ours].copy_(tensor)
                    vision_loaded.add(ours)
                else:
                    yield ours, tensor

        super().load_weights(text_weights())
        missing = [n for n in params if n.startswith(VISION_PREFIXES) and n not in vision_loaded]
        if missing:
            raise UnsupportedModelError(f"weights missing from the checkpoint: {missing[:5]}")

    def _text_parameters(self) -> list[str]:
        return [n for n in super()._text_parameters() if not n.startswith(VISION_PREFIXES)]

    def init_dummy_weights(self, seed: int) -> None:
        super().init_dummy_weights(seed)
        with torch.no_grad():  # LayerNorms as initialised (the decoder's loop drew them at random)
            for module in self.vision_tower.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for an HF LLaVA weight (text ones: as LlamaForCausalLM.load_weights takes them), or None
    for weights the model does not use."""
    for prefix in ("model.", ""):
        if name.startswith(prefix + "multi_modal_projector."):
            return "projector." + name.removeprefix(prefix + "multi_modal_projector.")
        if name.startswith(prefix + "vision_tower."):
            rest = name.removeprefix(prefix + "vision_tower.").removeprefix("vision_model.")
            if rest.startswith("encoder."):
                rest = rest.removeprefix("encoder.")
            if rest.startswith("post_layernorm."):
                return None
            return "vision_tower." + rest
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name  # lm_head.weight
