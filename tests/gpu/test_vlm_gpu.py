"""LLaVA on CUDA against HF transformers (tiny random config): the vision features and the logits of a prompt with
two images, on the GPU attention backends; the images' prompt through the real server is tests/test_vlm.py's."""

from __future__ import annotations

import pytest
import torch

from gramserve.model.runner import ModelRunner, RunnerConfig
from tests.test_llava_model import IMAGE_TOKEN, tiny_llava
from tests.test_model_vs_hf import Harness


@pytest.mark.parametrize("backend", ["triton", "torch"])
@torch.inference_mode()
def test_llava_on_cuda_matches_hf(tmp_path, backend):
    hf = tiny_llava(tmp_path).cuda()
    runner = ModelRunner(
        RunnerConfig(
            model_path=str(tmp_path), device="cuda", dtype="float32", attention_backend=backend,
            kv_cache_memory_gb=0.05, max_running_requests=4, cuda_graph_max_bs=0,
        )
    )  # fmt: skip
    pixels = torch.randn(2, 3, 56, 56, device="cuda")
    ours = runner.model.encode_images(pixels)
    ref = hf.model.get_image_features(
        pixel_values=pixels, vision_feature_layer=-2, vision_feature_select_strategy="default"
    )
    ref = torch.stack(list(ref.pooler_output if hasattr(ref, "pooler_output") else ref))
    torch.testing.assert_close(ours, ref.view_as(ours), atol=2e-3, rtol=2e-3)
    n = runner.config.vision.tokens_per_image
    prompt = [5, 17] + [IMAGE_TOKEN] * n + [99, 3] + [IMAGE_TOKEN] * n + [250, 8]
    ids = torch.tensor(prompt, device="cuda")
    rows = (ids == IMAGE_TOKEN).nonzero().flatten()
    h = Harness(runner)
    logits = h.extend([h.pool.alloc()], [0], [prompt], all_logits=True, input_embeds=(rows, ours.reshape(-1, 64)))
    want = hf(input_ids=ids[None], pixel_values=pixels).logits[0]
    torch.testing.assert_close(logits, want, atol=2e-3, rtol=2e-3)
