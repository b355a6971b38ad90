"""The decoder shape we need, read from an HF config.json (Llama, Mistral, Qwen2, Qwen3 families; LLaVA: its
text model's shape plus the vision tower's, `VisionConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Vision-language models: the text model's family comes from text_config's model_type.
VLM_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava"}
TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA model's CLIP vision tower and projector (HF LlavaConfig's vision_config and top-level fields)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str  # the tower's MLP: quick_gelu (CLIP) or gelu
    feature_layer: int  # which hidden state feeds the projector (HF: -2, the second to last layer's output)
    select_strategy: str  # "default": drop the class token; "full": keep it
    projector_act: str
    projector_bias: bool
    image_token_id: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_run(self) -> int:
        """Encoder layers whose output the feature layer needs (hidden state i is the output of layer i)."""
        layer = self.feature_layer if self.feature_layer >= 0 else self.num_layers + 1 + self.feature_layer
        return layer

    @classmethod
    def from_llava(cls, cfg: dict[str, Any]) -> "VisionConfig":
        v = cfg["vision_config"]
        if v.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedModelError(f"LLaVA vision tower {v.get('model_type')!r}: gramserve runs CLIP's")
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise UnsupportedModelError("LLaVA with several vision feature layers is not supported")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        return cls(
            hidden_size=v.get("hidden_size", 768),
            intermediate_size=v.get("intermediate_size", 3072),
            num_layers=v.get("num_hidden_layers", 12),
            num_heads=v.get("num_attention_heads", 12),
            image_size=v.get("image_size", 224),
            patch_size=v.get("patch_size", 32),
            num_channels=v.get("num_channels", 3),
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
            hidden_act=v.get("hidden_act", "quick_gelu"),
            feature_layer=layer,
            select_strategy=strategy,
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
        )


@dataclass
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    vision: VisionConfig | None = None  # a vision-language model's tower (architecture: its VLM class)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        vlm = next((a for a in archs if a in VLM_ARCHITECTURES), None)
        if vlm is not None:
            text = dict(cfg.get("text_config") or {})
            model_type = text.pop("model_type", "llama")
            text_arch = TEXT_MODEL_TYPES.get(model_type)
            if text_arch is None:
                raise UnsupportedModelError(f"{vlm} with a {model_type!r} text model is not supported")
            # Checkpoints keep only what differs from the text model's defaults (llava-1.5-7b-hf names no sizes).
            from transformers import AutoConfig

            text = AutoConfig.for_model(model_type, **text).to_dict()
            text.setdefault("eos_token_id", cfg.get("eos_token_id"))
            text_cfg = cls.from_dict({**text, "architectures": [text_arch]})
            return replace(text_cfg, architecture=vlm, vision=VisionConfig.from_llava(cfg))
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = sorted(SUPPORTED_ARCHITECTURES) + sorted(VLM_ARCHITECTURES)
            raise UnsupportedModelError(f"architectures {archs} not supported; gramserve runs {supported}")
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5 moved rope settings into `rope_parameters`.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * h
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h
