"""ModelRunner: builds the model on its device, loads weights, sizes and owns the KV cache, runs forwards."""

from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass

import torch

from gramserve.config import ServerArgs
from gramserve.model.attention import create_backend
from gramserve.model.forward_batch import ForwardBatch
from gramserve.model.kv_cache import KVCache
from gramserve.model.llama import LlamaForCausalLM
from gramserve.model.loader import load_config_dict, resolve_model
from gramserve.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunnerInfo:
    """What the runner tells the rest of the server at start-up."""

    model_path: str
    architecture: str
    device: str
    dtype: str
    context_length: int
    max_total_tokens: int  # KV slots in the pool
    vocab_size: int  # logits width
    eos_token_ids: list[int]
    num_params: int
    load_seconds: float


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, args: ServerArgs, max_running_requests: int):
        t0 = time.time()
        self.args = args
        self.device = pick_device(args.device)
        self.dtype = pick_dtype(args.dtype, self.device)
        path, kind = resolve_model(args.model_path, args.load_format)
        self.model_dir = path if os.path.isdir(path) else os.path.dirname(path)
        self.config = ModelConfig.from_dict(load_config_dict(path))
        self.context_length = min(args.context_length or self.config.max_position_embeddings,
                                  self.config.max_position_embeddings)

        self.model = self._build_model()
        if kind == "dummy":
            self.model.init_dummy_weights(args.seed)
        else:
            self._load_safetensors(path)

        num_slots = self._kv_slots(max_running_requests)
        self.kv_cache = KVCache(self.config.num_layers, num_slots, self.config.num_kv_heads,
                                self.config.head_dim, self.dtype, self.device)
        self.backend = create_backend(args.attention_backend, self.kv_cache)
        self.info = RunnerInfo(
            model_path=path, architecture=self.config.architecture, device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."), context_length=self.context_length,
            max_total_tokens=num_slots, vocab_size=self.config.vocab_size,
            eos_token_ids=self.config.eos_token_ids, num_params=self.config.num_params(),
            load_seconds=time.time() - t0,
        )
        logger.info("model %s loaded on %s (%s) in %.1f s; KV pool %d tokens",
                    self.config.architecture, self.device, self.info.dtype, self.info.load_seconds, num_slots)

    def _build_model(self) -> LlamaForCausalLM:
        # Built on the meta device so that no time goes into random init of weights we overwrite.
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                model = LlamaForCausalLM(self.config, self.context_length)
        finally:
            torch.set_default_dtype(prev_dtype)
        model = model.to_empty(device=self.device)
        model.rope.reset_tables()
        return model.eval().requires_grad_(False)

    def _load_safetensors(self, folder: str) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))

        def tensors():
            for f in files:
                with safe_open(f, framework="pt", device="cpu") as sf:
                    for name in sf.keys():
                        yield name, sf.get_tensor(name)

        self.model.load_weights(tensors())

    def _kv_slots(self, max_running_requests: int) -> int:
        per_token = KVCache.bytes_per_token(self.config.num_layers, self.config.num_kv_heads,
                                            self.config.head_dim, self.dtype)
        if self.args.kv_cache_memory_gb is not None:
            budget = self.args.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            activations = 2 * 2**30
            budget = total * self.args.mem_fraction_static - used - activations
        else:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(2 * 2**30, 0.2 * avail)
        slots = int(budget // per_token)
        # More slots than every running request at full context could use would be wasted memory.
        slots = min(slots, max_running_requests * self.context_length)
        if slots < self.context_length // 4:
            raise RuntimeError(f"KV budget of {budget / 2**30:.2f} GiB holds only {slots} tokens; give more memory")
        return slots

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.backend)
