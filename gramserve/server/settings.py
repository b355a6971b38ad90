"""Resolve every `auto` of the command line, once: ServerArgs -> Settings.

Each rule lives with the code it concerns (attention backends in `model/attention`, sampling backends in
`sampling/flashinfer_sampling`, fill threads in `grammar/fill`, batch sizes in `config.DEVICE_DEFAULTS`); this
module is the one place that applies them. The launcher logs the result at start-up and /get_server_info reports
it; in-process users (tests, benchmarks) call `resolve_settings` or `in_process_config` the same way.
"""

from __future__ import annotations

import torch

from gramserve.config import (
    DEVICE_DEFAULTS,
    LORA_TARGET_MODULES,
    LaunchInfo,
    ServerArgs,
    ServerConfig,
    Settings,
    available_cores,
)
from gramserve.grammar.fill import resolve_fill_threads
from gramserve.model.attention import resolve_backend_name
from gramserve.model.lora.adapter import LoRAAdapterError, read_adapter_config
from gramserve.sampling.flashinfer_sampling import resolve_sampling_backend

GPU_HOST_THREADS = 2


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str, device: str) -> str:
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name


def scheduler_threads(device: str, model_processes: int = 1) -> int:
    """Torch CPU threads for the scheduler process (and for each tensor-parallel rank / data-parallel replica: the
    `model_processes` of them share the cores)."""
    if device == "cuda":
        # The model runs on the GPU; host tensor ops are small (ids, bitmask copies). Idle OpenMP threads spin
        # after each parallel op and would take cores from the grammar workers' fill threads.
        return GPU_HOST_THREADS
    # A decode step on a CPU is bound by memory bandwidth, which one core does not fill: up to 4 cores the
    # forward takes them all (2 cores, default model: 22 ms a token through HTTP against 36 ms with one thread;
    # the HTTP server and detokenizer need about 7% of a core). Past 4, two cores stay with the other processes.
    # torch and the CPU kernels share one OpenMP runtime, so one count serves both.
    cores = available_cores()
    return max(1, (cores if cores <= 4 else cores - 2) // model_processes)


DEFAULT_MAX_LORA_RANK = 16


def resolve_lora(args: ServerArgs) -> dict:
    """The LoRA settings: off, or the pool's rank (the largest start-up adapter's, at least 16, unless given), its
    slots, the host cache and the start-up adapters (each folder's config checked here: a bad one stops the
    start with its reason)."""
    if not args.lora_enabled:
        return {}
    modules = tuple(tuple(m.split("=", 1)) for m in args.lora_modules)
    ranks = []
    for name, path in modules:
        try:
            config = read_adapter_config(path)
        except LoRAAdapterError as exc:
            raise ValueError(f"--lora-modules {name}: {exc}") from None
        ranks += [config.rank, *[int(r) for r in config.rank_pattern.values()]]
    rank = args.max_lora_rank or max([DEFAULT_MAX_LORA_RANK, *ranks])
    return dict(
        max_lora_rank=rank,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras or 4 * args.max_loras_per_batch,
        lora_target_modules=tuple(args.lora_target_modules or LORA_TARGET_MODULES),
        lora_modules=modules,
    )


def resolve_settings(args: ServerArgs) -> Settings:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    defaults = DEVICE_DEFAULTS[device]

    def given_or_default(name: str) -> int:
        value = getattr(args, name)
        return getattr(defaults, name) if value is None else value

    # One grammar process per two cores, up to the cap; on 16 cores 8 processes of one fill thread each
    # (resolve_fill_threads). Processes fill in parallel where one process's threads take turns with the GIL between
    # rows (docs/benchmarks.md, issue 18 run 20: 8 x 1 filled a step sooner than 4 x 2 on a 16-core H200 host).
    shards = args.grammar_shards or min(defaults.max_grammar_shards, max(1, available_cores() // 2))
    # auto: on for CUDA (the CPU work of step N+1 runs while the GPU computes step N), off on CPU, where the
    # forward is synchronous and overlapping only costs one wasted token per finishing request.
    overlap = device == "cuda" if args.overlap_schedule == "auto" else args.overlap_schedule == "on"
    # auto: on for a CPU, where a prefill step's GEMMs take the running rows almost for free.
    mixed = device == "cpu" if args.mixed_decode == "auto" else args.mixed_decode == "on"
    graphs = 0 if device != "cuda" or args.disable_cuda_graph else given_or_default("cuda_graph_max_bs")
    no_graphs = device != "cuda" or args.disable_cuda_graph or args.tp_size > 1  # pieces: one GPU, for now
    prefill_graphs = 0 if no_graphs else given_or_default("prefill_graph_max_tokens")
    model_processes = args.tp_size // args.nnodes * args.dp_size  # on this host
    return Settings(
        device=device,
        dtype=dtype,
        attention_backend=resolve_backend_name(args.attention_backend, torch.device(device), getattr(torch, dtype)),
        sampling_backend=resolve_sampling_backend(args.sampling_backend, torch.device(device)),
        overlap_schedule=overlap,
        mixed_decode=mixed,
        max_running_requests=given_or_default("max_running_requests"),
        chunked_prefill_size=given_or_default("chunked_prefill_size"),
        cuda_graph_max_bs=max(0, graphs),
        prefill_graph_max_tokens=max(0, prefill_graphs),
        max_consecutive_prefills=given_or_default("max_consecutive_prefills"),
        max_prefill_wait_steps=given_or_default("max_prefill_wait_steps"),
        grammar_shards=shards,
        grammar_fill_threads=resolve_fill_threads(args.grammar_fill_threads, shards),
        scheduler_threads=args.num_threads or scheduler_threads(device, model_processes),
        cpu_kernel_threads=args.cpu_kernel_threads or args.num_threads or scheduler_threads(device, model_processes),
        **resolve_lora(args),
    )


def in_process_config(args: ServerArgs | None = None, **launch) -> ServerConfig:
    """A ServerConfig for an engine built in this process (tests, benchmarks): `launch` fills LaunchInfo."""
    args = args if args is not None else ServerArgs()
    return ServerConfig(args, resolve_settings(args), LaunchInfo(**launch))
