"""LLaVA in our model code against HF transformers' LlavaForConditionalGeneration, on random weights of a tiny
config (no VLM weights ship in a package): the vision features, the logits of a prompt holding an image's
placeholder tokens, and greedy decoding after it."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_hf import Harness

from gramserve.model.runner import ModelRunner, RunnerConfig

IMAGE_TOKEN = 299


def tiny_llava(path, strategy: str = "default", feature_layer: int = -2):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
        patch_size=14, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy=strategy, vision_feature_layer=feature_layer,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF initialises biases to zero and LayerNorms to one: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name or "class_embedding" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("strategy,feature_layer", [("default", -2), ("full", -1)])
@torch.inference_mode()
def test_llava_matches_hf(tmp_path, strategy, feature_layer):
    hf = tiny_llava(tmp_path, strategy, feature_layer)
    runner = ModelRunner(RunnerConfig(model_path=str(tmp_path), kv_cache_memory_gb=0.01, max_running_requests=4))
    vision = runner.config.vision
    n_img = vision.tokens_per_image
    assert n_img == 16 + (strategy == "full")
    pixels = torch.randn(2, 3, 56, 56)

    # the vision features (tower + projector) per image
    ours = runner.model.encode_images(pixels)
    ref = hf.model.get_image_features(
        pixel_values=pixels, vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy
    )
    ref = torch.stack(list(ref.pooler_output if hasattr(ref, "pooler_output") else ref))
    torch.testing.assert_close(ours, ref.view_as(ours), atol=1e-4, rtol=1e-4)

    # a prompt with two images, and one with none, in one batch
    h = Harness(runner)
    prompts = [
        [5, 17] + [IMAGE_TOKEN] * n_img + [99, 3] + [IMAGE_TOKEN] * n_img + [250, 8],
        [300 - 2, 2, 77],
    ]
    rows = [h.pool.alloc() for _ in prompts]
    ids = torch.tensor(prompts[0])
    image_rows = (ids == IMAGE_TOKEN).nonzero().flatten()
    logits = h.extend(rows, [0, 0], prompts, all_logits=True, input_embeds=(image_rows, ours.reshape(-1, 64)))
    ref_logits = hf(input_ids=ids[None], pixel_values=pixels).logits[0]
    torch.testing.assert_close(logits[: len(prompts[0])], ref_logits, atol=1e-4, rtol=1e-4)
    text_ref = hf(input_ids=torch.tensor([prompts[1]])).logits[0]
    torch.testing.assert_close(logits[len(prompts[0]) :], text_ref, atol=1e-4, rtol=1e-4)

    # greedy decoding after the image prompt equals HF generate
    want = hf.generate(input_ids=ids[None], pixel_values=pixels, max_new_tokens=6, do_sample=False)[0, len(ids) :]
    got, length = [int(logits[len(prompts[0]) - 1].argmax())], len(prompts[0])
    for _ in range(5):
        step = h.decode(rows[:1], [length], [got[-1]])
        length += 1
        got.append(int(step[0].argmax()))
    assert got == want.tolist()


def test_a_published_llava_config_reads_with_its_text_defaults():
    """llava-hf/llava-1.5-7b-hf's config.json names no sizes for its text model (LlamaConfig's defaults)."""
    from gramserve.model.model_config import ModelConfig

    published = {
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
        "text_config": {
            "_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "tie_word_embeddings": False, "torch_dtype": "float16",
        "vision_config": {
            "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
            "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
    }  # fmt: skip
    cfg = ModelConfig.from_dict(published)
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    assert shape == (4096, 11008, 32, 32, 32, 32064)
    assert cfg.architecture == "LlavaForConditionalGeneration" and cfg.family == "llama"
    v = cfg.vision
    assert (v.tokens_per_image, v.layers_run, v.hidden_act, v.image_token_id) == (576, 23, "quick_gelu", 32000)
