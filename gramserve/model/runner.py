"""ModelRunner: builds the model on its device, loads weights, sizes and owns the KV cache, runs forwards.

It takes a `RunnerConfig` whose `auto` values are already resolved. On CUDA it sizes the KV pool from
`--mem-fraction-static` after the weights and an activation reserve, and replays decode CUDA graphs.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass

import torch

from gramserve.host_memory import available_memory_bytes
from gramserve.model.attention import create_backend
from gramserve.model.forward_batch import ForwardBatch
from gramserve.model.kv_cache import KVCache
from gramserve.model.llama import LlamaForCausalLM
from gramserve.model.llava import LlavaForConditionalGeneration
from gramserve.model.loader import default_gguf_path, load_config_dict, resolve_model
from gramserve.model.lora.adapter import TARGET_MODULES
from gramserve.model.lora.pool import LoRAPool
from gramserve.model.model_config import ModelConfig, UnsupportedModelError
from gramserve.model.parallel import TPConfig, TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner needs, with every `auto` already resolved (see `server/settings.py`)."""

    model_path: str | None = None  # GGUF file, HF-format folder, or config.json (dummy weights); None: default model
    load_format: str = "auto"  # auto | dummy
    device: str = "cpu"  # cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16
    quantization: str = "none"  # none | fp8 (model/fp8_linear.py)
    attention_backend: str = "torch"  # torch | flashinfer | triton | flashinfer_triton
    context_length: int | None = None  # None: the model's max_position_embeddings
    kv_cache_memory_gb: float | None = None  # KV pool budget; None: a share of free memory
    mem_fraction_static: float = 0.85  # GPU: fraction of device memory for weights + KV
    max_running_requests: int = 16  # sizes the KV pool's cap and the activation reserve
    max_step_tokens: int = 512  # most tokens one prefill step runs (activation reserve)
    cuda_graph_max_bs: int = 0  # decode batches up to this size replay CUDA graphs; 0: none
    prefill_graph_max_tokens: int = 0  # prefill batches up to this many tokens replay piecewise graphs; 0: none
    seed: int = 0  # dummy weights
    # float32 on a CPU: auto = a GGUF's own Q4_1/Q8_0 blocks for decode (the same weight values, fewer bytes),
    # floats otherwise; q8_0 = every projection rounded to Q8_0 blocks; float = no blocks.
    cpu_weights: str = "auto"
    cpu_kernel_threads: int = 1  # threads of the CPU kernels
    lora_slots: int = 0  # adapters one batch may use (the device pool's slots); 0: LoRA off
    max_lora_rank: int = 16
    lora_target_modules: tuple[str, ...] = TARGET_MODULES
    tp: TPConfig = TPConfig()  # this rank's place in its tensor-parallel group (model/parallel.py)


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
    attention_backend: str = "torch"
    cpu_decode: str = "torch"  # CPU decode path: torch | kernels (norms, attention) | kernels+<weight format>
    cuda_graph_max_bs: int = 0  # 0: decode runs without CUDA graphs
    prefill_graph_max_tokens: int = 0  # 0: prefill runs without CUDA graphs
    memory: dict | None = None  # GiB: weights, kv_pool, activation reserve, device total (CUDA only)
    lora_slots: int = 0  # LoRA adapter slots of the device pool (0: LoRA off)
    lora_rank: int = 0  # the pool's rank (max rank rounded up to 16)
    lora_pool_mib: float = 0.0
    tp_size: int = 1
    quantization: str = "none"  # none | fp8


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        t0 = time.time()
        self.cfg = cfg = config
        self.device = torch.device(cfg.device)
        parallel = cfg.tp.size > 1 or cfg.tp.device_index > 0
        if self.device.type == "cuda" and self.device.index is None and parallel:  # this rank's / replica's GPU
            self.device = torch.device("cuda", cfg.tp.device_index)
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, cfg.dtype)
        path, kind = resolve_model(cfg.model_path, cfg.load_format)
        self.model_dir = path if os.path.isdir(path) else os.path.dirname(path)
        self.config = ModelConfig.from_dict(load_config_dict(path))
        if cfg.tp.size > 1 and (self.config.vision is not None or cfg.lora_slots > 0):
            what = "a vision-language model" if self.config.vision is not None else "LoRA adapters"
            raise UnsupportedModelError(f"{what} with tp_size > 1 is not supported yet; use tp_size 1")
        self.tp = TPGroup(cfg.tp, self.device)
        self.context_length = min(
            cfg.context_length or self.config.max_position_embeddings, self.config.max_position_embeddings
        )

        self.model = self._build_model()
        if kind == "dummy":
            self.model.init_dummy_weights(cfg.seed)
        else:
            self._load_safetensors(path)
        if cfg.quantization == "fp8":  # before the KV pool is sized: it gets the memory the float weights held
            self._use_fp8_weights()

        self.lora_pool: LoRAPool | None = None
        if cfg.lora_slots > 0:  # before the KV cache is sized: the pool's memory is not the KV cache's
            self.lora_pool = LoRAPool(
                self.config, cfg.lora_slots, cfg.max_lora_rank, cfg.lora_target_modules, self.dtype, self.device
            )
        self.memory: dict | None = None
        part = self.model.part
        num_slots = self.tp.min_int(self._kv_slots(cfg.max_running_requests))  # the same slots on every rank
        if num_slots < self.context_length:
            # One request may not grow past the pool: alone, nothing could be retracted for it, and the step that
            # found no free slot failed every request in flight. Its context is what the pool holds.
            logger.warning(
                "the KV pool holds %d tokens, fewer than the context length %d: the context is %d tokens "
                "(more memory for the KV cache: --kv-cache-memory-gb)",
                num_slots,
                self.context_length,
                num_slots,
            )
            self.context_length = num_slots
        self.kv_cache = KVCache(
            self.config.num_layers, num_slots, part.num_kv_heads, self.config.head_dim, self.dtype, self.device
        )
        if self.memory is not None:
            self.memory["kv_pool_gib"] = round(self.kv_cache.nbytes / 2**30, 2)
        backend_name = cfg.attention_backend
        self.backend = create_backend(backend_name, self.kv_cache, part.num_heads)
        cpu_decode = self._use_cpu_kernels(kind)
        if self.lora_pool is not None:
            self.model.use_lora(self.lora_pool)
        self.graph_runner = None  # made by init_cuda_graphs once the req_to_token table exists
        self.prefill_graphs = None  # made by init_cuda_graphs
        self.info = RunnerInfo(
            model_path=path,
            architecture=self.config.architecture,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            context_length=self.context_length,
            max_total_tokens=num_slots,
            vocab_size=self.config.vocab_size,
            eos_token_ids=self.config.eos_token_ids,
            num_params=self.config.num_params(),
            load_seconds=time.time() - t0,
            attention_backend=backend_name,
            cpu_decode=cpu_decode,
            memory=self.memory,
        )
        if self.lora_pool is not None:
            self.info.lora_slots, self.info.lora_rank = cfg.lora_slots, self.lora_pool.rank
            self.info.lora_pool_mib = round(self.lora_pool.nbytes / 2**20, 1)
        self.info.tp_size = self.tp.size
        self.info.quantization = cfg.quantization
        # Tensor parallelism: rank 0 sends every step to the others (model/tp_step.py).
        self.step_sender = self.step_receiver = None
        if self.tp.size > 1:  # every rank at once: they exchange the channel's addresses
            from gramserve.model.tp_step import StepReceiver, StepSender

            if self.tp.is_driver:
                self.step_sender = StepSender(self.tp)
            else:
                self.step_receiver = StepReceiver(self.tp, self.device)
        logger.info(
            "model %s loaded on %s (%s, %s attention%s) in %.1f s; KV pool %d tokens",
            self.config.architecture,
            self.device,
            self.info.dtype,
            backend_name,
            f", tensor parallel rank {self.tp.rank} of {self.tp.size}" if self.tp.size > 1 else "",
            self.info.load_seconds,
            num_slots,
        )
        if self.memory is not None:
            logger.info("GPU memory (GiB): %s", self.memory)

    def _use_cpu_kernels(self, kind: str) -> str:
        """float32 on a CPU: norms, decode attention and (where blocks exist) decode matmuls through the kernel
        library. Returns what the decode runs on, for RunnerInfo and the log."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or self.cfg.quantization != "none":
            return "torch"
        from gramserve.model import cpu_kernels
        from gramserve.model.quant_weights import gguf_blocks, quantize_q8_0

        lib = cpu_kernels.load()
        if lib is None:
            return "torch"
        cpu_kernels.set_threads(self.cfg.cpu_kernel_threads)
        blocks, source = {}, ""
        gguf = self.cfg.model_path or (default_gguf_path() if kind != "dummy" else None)
        # Under tensor parallelism `auto` keeps the floats: the GGUF's blocks hold whole matrices, not a rank's share.
        whole = self.tp.size == 1
        if self.cfg.cpu_weights == "auto" and whole and kind == "hf" and gguf and gguf.endswith(".gguf"):
            # In a subfolder: the model's own *.safetensors are globbed from model_dir.
            cache_file = os.path.join(self.model_dir, "cpu", "gguf_blocks.safetensors")
            blocks, source = gguf_blocks(gguf, self.model.hf_weights(), cache_file), "gguf"
        elif self.cfg.cpu_weights == "q8_0":
            blocks = {n: quantize_q8_0(w) for n, w in self.model.hf_weights().items() if w.shape[-1] % 32 == 0}
            source = "q8_0"
        swapped = self.model.use_cpu_kernels(lib, blocks)
        if hasattr(self.backend, "use_cpu_kernels"):
            self.backend.use_cpu_kernels(lib)
        if not swapped:
            return "kernels"
        nbytes = sum(b.nbytes for b in blocks.values())
        logger.info("CPU decode: %d projections read %s blocks (%.0f MB)", swapped, source, nbytes / 2**20)
        return f"kernels+{source}"

    def _use_fp8_weights(self) -> None:
        from gramserve.model.fp8_linear import check_fp8_device, use_fp8_weights

        check_fp8_device(self.device, self.dtype)
        t0 = time.time()
        swapped, kept = use_fp8_weights(self.model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the float weights' memory goes back to the device, for the KV pool
        logger.info("--quantization fp8: %d projections in e4m3 (%.1f s)", swapped, time.time() - t0)

    def _build_model(self) -> LlamaForCausalLM:
        # Built on the meta device so that no time goes into random init of weights we overwrite.
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                model_class = LlavaForConditionalGeneration if self.config.vision is not None else LlamaForCausalLM
                model = model_class(self.config, self.context_length, self.tp)
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
        per_token = KVCache.bytes_per_token(
            self.config.num_layers, self.model.part.num_kv_heads, self.config.head_dim, self.dtype
        )
        host_available = available_memory_bytes()
        if self.cfg.kv_cache_memory_gb is not None:
            budget = self.cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # weights, CUDA context, and whatever else runs on this GPU
            activations = self._activation_bytes(max_running_requests)
            # The static share holds weights + KV; activations and CUDA graphs come out of the rest, and
            # where the rest is too small for our estimate the KV pool gives way.
            budget = total * self.cfg.mem_fraction_static - used
            budget -= max(0.0, activations - total * (1 - self.cfg.mem_fraction_static))
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.memory = {
                "device_total_gib": round(total / 2**30, 2),
                "weights_gib": round(weights / 2**30, 2),
                "used_before_kv_gib": round(used / 2**30, 2),
                "activation_reserve_gib": round(activations / 2**30, 2),
                "mem_fraction_static": self.cfg.mem_fraction_static,
            }
        else:  # MemAvailable, not free pages: page cache counts (free pages moved the pool 16k-46k between starts)
            free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(2 * 2**30, 0.2 * (host_available or free_pages))
        slots = int(budget // per_token)
        # More slots than every running request at full context could use would be wasted memory.
        slots = min(slots, max_running_requests * self.context_length)
        if self.device.type == "cpu" and host_available is not None and slots * per_token > 0.9 * host_available:
            # Asked for with --kv-cache-memory-gb: past what the host has, the pool's first use got the process
            # killed by the kernel's OOM killer, with nothing said.
            raise RuntimeError(
                f"--kv-cache-memory-gb {self.cfg.kv_cache_memory_gb}: a KV pool of {slots * per_token / 2**30:.1f} "
                f"GiB does not fit in the {host_available / 2**30:.1f} GiB of memory available; give less"
            )
        if slots < self.context_length // 4:
            raise RuntimeError(f"KV budget of {budget / 2**30:.2f} GiB holds only {slots} tokens; give more memory")
        return slots

    def _activation_bytes(self, max_running_requests: int) -> float:
        """Rough peak of transient memory: logits of the largest batch (+ sampler copies), one prefill chunk's
        hidden states, workspaces and CUDA graphs."""
        cfg, elt = self.config, torch.empty((), dtype=self.dtype).element_size()
        logits = max_running_requests * cfg.vocab_size * 4 * 3
        tokens = self.cfg.max_step_tokens
        per_token = (
            cfg.hidden_size * 4 + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * 3 + cfg.intermediate_size * 3
        ) * elt
        return logits + tokens * per_token + 1.5 * 2**30

    def init_cuda_graphs(self, req_to_token: torch.Tensor) -> None:
        """Capture decode graphs over the scheduler's req_to_token table (graph-capable backend only), and the
        prefill steps' piecewise graphs (one GPU only: their pieces hold no cross-rank schedule yet). CUDA only."""
        if self.device.type != "cuda":
            return
        max_bs = self.cfg.cuda_graph_max_bs
        if max_bs > 0 and self.backend.supports_cuda_graph:
            from gramserve.model.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self.model, self.backend, req_to_token, max_bs, self.cfg.lora_slots)
            self.graph_runner.capture()
            self.info.cuda_graph_max_bs = self.graph_runner.max_bs
        if self.cfg.prefill_graph_max_tokens > 0 and self.tp.size == 1:
            from gramserve.model.prefill_graphs import PrefillGraphRunner

            # No step runs more tokens than max_step_tokens: larger graphs would only take memory.
            most = min(self.cfg.prefill_graph_max_tokens, self.cfg.max_step_tokens)
            self.prefill_graphs = PrefillGraphRunner(self.model, self.backend, most)
            self.prefill_graphs.capture()
            self.info.prefill_graph_max_tokens = self.prefill_graphs.max_tokens
        if self.memory is not None and (self.graph_runner is not None or self.prefill_graphs is not None):
            free, _ = torch.cuda.mem_get_info(self.device)
            self.memory["free_after_graphs_gib"] = round(free / 2**30, 2)
            logger.info("GPU memory after graph capture (GiB): %s", self.memory)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.step_sender is not None:  # tensor parallel: the other ranks run the same step
            self.step_sender.send(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            return self.prefill_graphs.run(batch)
        return self.model(batch, self.backend)

    def follow(self, req_to_token: torch.Tensor) -> None:
        """A tensor-parallel rank other than 0: run every step rank 0 sends, until it stops. `req_to_token`: this
        rank's copy of the slot table (the one its CUDA graphs read)."""
        receiver = self.step_receiver
        receiver.table = req_to_token
        try:
            while (batch := receiver.receive()) is not None:
                with torch.inference_mode():
                    if self.graph_runner is not None and self.graph_runner.can_run(batch):
                        self.graph_runner.replay(batch)
                    else:
                        self.model(batch, self.backend)
        finally:
            receiver.close()

    def close(self) -> None:
        """Tell the other tensor-parallel ranks to stop (rank 0)."""
        if self.step_sender is not None:
            self.step_sender.close()
            self.step_sender = None
