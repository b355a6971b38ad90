"""Every supported family against HF transformers: tiny random-weight checkpoints written as safetensors.

Covers what SmolLM2 (a Llama) does not: Qwen2's q/k/v bias, Qwen3's q/k norm, Mistral, untied
embeddings, llama3 RoPE scaling, and a logits width larger than the tokenizer's vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from test_model_vs_hf import Harness

from gramserve.model.runner import ModelRunner, RunnerConfig

BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

FAMILIES = {
    "llama3-scaled": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0, head_dim=16)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_family_matches_hf(family, tmp_path):
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**BASE, **extra})
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)

    runner = ModelRunner(RunnerConfig(model_path=str(tmp_path), kv_cache_memory_gb=0.01, max_running_requests=4))
    assert runner.config.family in family
    h = Harness(runner)
    prompts = [[5, 17, 99, 3, 250, 8, 41], [300, 2, 77], list(range(10, 60))]
    rows = [h.pool.alloc() for _ in prompts]
    logits = h.extend(rows, [0] * 3, prompts, all_logits=True)
    start = 0
    for p in prompts:
        ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start : start + len(p)], ref, atol=1e-4, rtol=1e-4)
        start += len(p)
    # decode a few steps greedily against HF generate
    outs = [[int(t)] for t in logits[[len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1, -1]].argmax(-1)]
    lens = [len(p) for p in prompts]
    for _ in range(7):
        step = h.decode(rows, lens, [o[-1] for o in outs])
        lens = [n + 1 for n in lens]
        for o, t in zip(outs, step.argmax(-1).tolist()):
            o.append(t)
    for p, ours in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )[0, len(p) :]
        assert ours == ref.tolist()
