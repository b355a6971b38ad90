"""The engine's processes: resolve the settings, derive the launch record, start the scheduler, detokenizer and
grammar worker processes, wait until the scheduler has loaded the model, watch them, and stop them.

Shared by the HTTP server (launch.py) and the in-process Engine (gramserve/engine.py): everything below the OpenAI
layer starts the same way for both.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gramserve.config import LaunchInfo, ServerArgs, ServerConfig, Settings, split_host_port
from gramserve.detokenizer.process import run_detokenizer_process
from gramserve.grammar.grammar_shm import create_grammar_shm
from gramserve.grammar.worker import run_grammar_worker, worker_name
from gramserve.host_memory import available_memory_bytes
from gramserve.ipc import SCHEDULER_IN, push_socket
from gramserve.messages import ReplicaDown
from gramserve.model.loader import default_tokenizer_dir, load_config_dict, resolve_model
from gramserve.model.model_config import ModelConfig, UnsupportedModelError
from gramserve.model.parallel import Partition, TPConfig
from gramserve.scheduler.dp_controller import run_dp_controller_process
from gramserve.scheduler.process import run_scheduler_process
from gramserve.scheduler.tp_worker import run_tp_worker_process
from gramserve.server.health import ServerHealth
from gramserve.server.settings import resolve_settings

logger = logging.getLogger("gramserve")


class StartupError(RuntimeError):
    pass


def tokenizer_dir_for(args: ServerArgs) -> str:
    """The folder whose tokenizer and chat template we use (also converts a GGUF once)."""
    if args.tokenizer_path:
        return args.tokenizer_path
    path, kind = resolve_model(args.model_path, args.load_format)
    if kind == "hf":
        return path
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.exists(os.path.join(folder, "tokenizer.json")) or os.path.exists(
        os.path.join(folder, "tokenizer_config.json")
    ):
        return folder
    return default_tokenizer_dir()


def resolve_parsers(args: ServerArgs, tokenizer) -> tuple[str, tuple[str, ...]]:
    """The tool-call parser's name (detected from the chat template unless given) and the markers of it and
    of the reasoning parser, which grammars may match as single special tokens."""
    from gramserve.parsers.reasoning import get_reasoning_parser
    from gramserve.parsers.tool_calls import detect_tool_call_parser, get_tool_call_parser

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    try:
        name = args.tool_call_parser or detect_tool_call_parser(template, None)
        markers = list(get_tool_call_parser(name).markers)
        if args.reasoning_parser:
            cls = get_reasoning_parser(args.reasoning_parser)
            markers += [cls.start_marker, cls.end_marker]
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    return name, tuple(dict.fromkeys(markers))


def read_chat_template(value: str) -> str:
    """--chat-template: a Jinja file (.jinja or any existing path) or the template text itself."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if value.endswith((".jinja", ".j2", ".txt")):
        raise StartupError(f"--chat-template: no such file {value!r}")
    return value


def check_parallel_fit(args: ServerArgs, model_cfg: ModelConfig) -> None:
    """Refuse, before any process starts, a tensor-parallel size the model cannot be split into, or GPUs that this
    host does not have."""
    if args.tp_size == 1:
        return
    try:
        Partition.of(model_cfg, 0, args.tp_size)
    except UnsupportedModelError as exc:
        raise StartupError(str(exc)) from None
    if model_cfg.vision is not None:
        raise StartupError("a vision-language model with tp_size > 1 is not supported yet; use tp_size 1")


PR_SET_NAME = 15  # prctl(2)
MEMORY_MARGIN_BYTES = 2 * 2**30  # beyond the weights: the KV pool's CPU default (at most 2 GiB) and the processes


def check_memory_fit(args: ServerArgs, settings: Settings, model_cfg: ModelConfig) -> None:
    """Refuse, before any process starts, a CPU model whose weights alone would not fit in the memory this host has
    available: loading them anyway filled the RAM until the kernel's OOM killer ended the scheduler (an 8B shape
    with random weights on a 24 GiB machine: 70 s, then "exit code -9")."""
    if settings.device != "cpu":
        return  # a GPU's memory is planned by the model runner (mem_fraction_static)
    available = available_memory_bytes()
    if available is None:
        return
    import torch

    per_copy = model_cfg.num_params() * torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    weights = per_copy * args.dp_size  # each replica holds the weights; tensor-parallel ranks split one copy
    if weights + MEMORY_MARGIN_BYTES > available:
        replicas = f" x {args.dp_size} replicas" if args.dp_size > 1 else ""
        raise StartupError(
            f"the model's weights need {weights / 2**30:.1f} GiB in {settings.dtype} "
            f"({model_cfg.num_params() / 1e9:.2f}B parameters{replicas}), and this host has "
            f"{available / 2**30:.1f} GiB of memory available (2 GiB more are needed beside them): "
            "use a smaller model, or a GPU"
        )


def check_devices(args: ServerArgs, settings: Settings) -> None:
    if settings.device != "cuda":
        return
    import torch

    need = args.tp_size // args.nnodes * args.dp_size
    have = torch.cuda.device_count()
    if need > have:
        raise StartupError(f"tp_size / nnodes x dp_size = {need} GPUs on this host, but it has {have}")


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dist_init_methods(args: ServerArgs) -> tuple[str, ...]:
    """torch.distributed's store address of each data-parallel replica (tensor parallelism only)."""
    if args.tp_size == 1:
        return ()
    if args.dist_init_addr:
        host, port = split_host_port(args.dist_init_addr)
        return tuple(f"tcp://{host}:{port + 1 + i}" for i in range(args.dp_size))
    return tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(args.dp_size))


def tp_config(config: ServerConfig, replica: int, rank: int) -> TPConfig:
    """Tensor-parallel rank `rank` of data-parallel replica `replica`: its store, CUDA device and channel host."""
    args = config.args
    if args.tp_size == 1:
        return TPConfig(device_index=replica)
    per_node = args.tp_size // args.nnodes
    channel_host = split_host_port(args.dist_init_addr)[0] if args.nnodes > 1 else "127.0.0.1"
    return TPConfig(
        size=args.tp_size,
        rank=rank,
        init_method=config.launch.dist_init_methods[replica],
        device_index=replica * args.tp_size + rank % per_node,
        channel_host=channel_host,
        one_host=args.nnodes == 1,
    )


def tp_worker_children(config: ServerConfig, replica: int, node_rank: int) -> list[tuple[str, Callable]]:
    """The (name, entry) of every tensor-parallel rank of `replica` on node `node_rank`, rank 0 excepted."""
    args = config.args
    per_node = args.tp_size // args.nnodes
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    prefix = f"tp-worker-dp{replica}" if args.dp_size > 1 else "tp-worker"
    return [
        (f"{prefix}-{r}", functools.partial(run_tp_worker_process, tp=tp_config(config, replica, r)))
        for r in ranks
        if r > 0
    ]


def set_nccl_environment() -> None:
    """NVLink multicast off for every child (the GPU hosts' notes: NVLS hangs or fails there)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _child_entry(target, config: ServerConfig, pipe) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    _name_process(process_name(mp.current_process().name))
    target(config, pipe)


# Linux keeps 15 bytes of a process name: replicas' and ranks' names are shortened to stay apart.
SHORT_NAMES = (("grammar-worker", "gram"), ("scheduler", "sched"), ("tp-worker", "tp"), ("dp-controller", "dpctl"))


def process_name(child: str) -> str:
    """What `ps -o comm` shows for the child named `child` (gs-scheduler, gs-detokenizer, gs-gram0-dp1, ...)."""
    name = "gs-" + child.replace("grammar-worker", "grammar")
    if len(name) > 15:
        name = "gs-" + functools.reduce(lambda n, pair: n.replace(*pair), SHORT_NAMES, child)
    return name[:15]


def _name_process(name: str) -> None:
    """The name `ps -o comm`, `top` and `htop` show (Linux; the command line stays multiprocessing's, which every
    child shares): an operator tells the scheduler, detokenizer and grammar workers apart."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name stays python's
        pass


def _wait_ready(name: str, proc: mp.Process, pipe, timeout: float = 600.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pipe.poll(0.5):
            try:
                msg = pipe.recv()
            except EOFError:  # it exited before saying anything (e.g. a script without `if __name__ == "__main__"`)
                proc.join(timeout=5)
                raise StartupError(f"{name} process died during start-up (exit code {proc.exitcode})") from None
            if isinstance(msg, dict) and "error" in msg:
                raise StartupError(f"{name} failed to start: {msg['error']}")
            return msg
        if not proc.is_alive():
            raise StartupError(f"{name} process died during start-up (exit code {proc.exitcode})")
    raise StartupError(f"{name} did not become ready in {timeout:.0f} s")


def describe_settings(settings: Settings) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.to_dict().items())


def derive_launch_info(
    args: ServerArgs, model_cfg: ModelConfig, tokenizer_dir: str, ipc_dir: str, tokenizer
) -> LaunchInfo:
    """What the child processes need besides the arguments: the tokenizer folder, the vocabulary, EOS ids and
    the resolved parsers (the grammar shared memory's name is added once it exists)."""
    check_parallel_fit(args, model_cfg)
    eos = set(model_cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    parser, text_tokens = resolve_parsers(args, tokenizer)
    return LaunchInfo(
        tokenizer_dir=tokenizer_dir,
        ipc_dir=ipc_dir,
        vocab_size=model_cfg.vocab_size,
        eos_token_ids=tuple(sorted(eos)),
        tool_call_parser=parser,
        grammar_text_tokens=text_tokens,
    )


@dataclass
class EngineProcesses:
    """The running child processes of one engine, and what the main process needs to talk to them."""

    config: ServerConfig
    tokenizer: Any
    runner_info: dict  # the scheduler's ready message: context length, KV pool size, vocabulary, ...
    health: ServerHealth
    procs: dict[str, mp.Process] = field(default_factory=dict)
    _ipc_dir: str = ""
    _shms: list = field(default_factory=list)

    def dead_child(self) -> str | None:
        return next((name for name, proc in self.procs.items() if not proc.is_alive()), None)

    def watch(self, on_death: Callable[[str], None], should_stop: Callable[[], bool]) -> threading.Thread:
        """A daemon thread that calls `on_death(name)` once when a child process dies (health records it first).
        Under data parallelism a process of one replica takes down only that replica (its other processes are
        stopped and the controller fails its requests) while another replica lives."""

        def loop() -> None:
            to_controller = None
            while not should_stop():
                name = self.dead_child()
                if name is None:
                    time.sleep(0.5)
                    continue
                code = self.procs[name].exitcode
                replica = replica_of(name)
                alive = [r for r in range(self.config.args.dp_size) if r not in self.health.dead_replicas]
                if replica is not None and alive != [replica]:
                    logger.error("%s process died (exit code %s); replica %d stops, the others serve", name, code,
                                 replica)  # fmt: skip
                    self.health.dead_replicas.add(replica)
                    _stop_processes({n: p for n, p in self.procs.items() if replica_of(n) == replica})
                    self.procs = {n: p for n, p in self.procs.items() if replica_of(n) != replica}
                    if to_controller is None:  # this thread's own socket (zmq sockets stay in their thread)
                        import zmq

                        to_controller = push_socket(zmq.Context.instance(), self.config.ipc_path(SCHEDULER_IN))
                    to_controller.send_pyobj(ReplicaDown(replica, f"its {name} process died"))
                    continue
                logger.error("%s process died (exit code %s); shutting down", name, code)
                self.health.dead_child = name
                on_death(name)
                return

        thread = threading.Thread(target=loop, name="child-watchdog", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop the children (terminate, then kill), remove the ipc folder and the grammar shared memory."""
        _stop_processes(self.procs)
        self.procs = {}
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        for shm in self._shms:
            shm.close()
            shm.unlink()
        self._shms = []


def replica_of(process_name: str) -> int | None:
    """The data-parallel replica a child process belongs to (its name ends in -dpN or holds -dpN-), else None."""
    match = re.search(r"-dp(\d+)(?:-|$)", process_name)
    return int(match.group(1)) if match else None


def replica_config(config: ServerConfig, replica: int, grammar_shm: str) -> ServerConfig:
    """The configuration of replica `replica`'s processes: its own grammar memory, sockets and share of the grammar
    workers."""
    args, settings = config.args, config.settings
    if args.dp_size == 1:
        return dataclasses.replace(config, launch=dataclasses.replace(config.launch, grammar_shm=grammar_shm))
    folder = os.path.join(config.launch.ipc_dir, f"dp{replica}")
    os.makedirs(folder, exist_ok=True)
    launch = dataclasses.replace(config.launch, grammar_shm=grammar_shm, replica=replica, replica_ipc_dir=folder)
    shards = max(1, settings.grammar_shards // args.dp_size)
    return ServerConfig(args, dataclasses.replace(settings, grammar_shards=shards), launch)


def start_engine_processes(args: ServerArgs) -> EngineProcesses:
    """Start every child process and wait until each is ready; raises StartupError (or ValueError for settings that
    do not fit together) after stopping whatever had started."""
    ipc_dir = tempfile.mkdtemp(prefix="gramserve-ipc-")
    if args.tp_size > 1:
        set_nccl_environment()
    ctx = mp.get_context("spawn")
    procs: dict[str, mp.Process] = {}
    shms = []
    try:
        from transformers import AutoTokenizer

        settings = resolve_settings(args)
        logger.info("settings: %s", describe_settings(settings))
        check_devices(args, settings)
        tokenizer_dir = tokenizer_dir_for(args)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if args.chat_template:
            tokenizer.chat_template = read_chat_template(args.chat_template)
        model_cfg = ModelConfig.from_dict(load_config_dict(resolve_model(args.model_path, args.load_format)[0]))
        check_memory_fit(args, settings, model_cfg)
        launch = derive_launch_info(args, model_cfg, tokenizer_dir, ipc_dir, tokenizer)
        launch = dataclasses.replace(launch, dist_init_methods=dist_init_methods(args))
        config = ServerConfig(args, settings, launch)
        pipes = {}
        # Each replica's scheduler loop writes its last time.monotonic() into its heartbeat (health.py).
        heartbeats = [ctx.Value("d", 0.0, lock=False) for _ in range(args.dp_size)]
        health = ServerHealth(heartbeats, args.watchdog_timeout, warming=not args.skip_warmup)
        children: list[tuple[str, Callable, ServerConfig]] = [("detokenizer", run_detokenizer_process, config)]
        if args.dp_size > 1:
            children.append(("dp-controller", run_dp_controller_process, config))
        schedulers = []
        for replica in range(args.dp_size):
            shms.append(create_grammar_shm(settings.max_running_requests, launch.vocab_size))
            rconfig = replica_config(config, replica, shms[-1].name)
            if replica == 0:
                config = dataclasses.replace(config, launch=dataclasses.replace(launch, grammar_shm=shms[0].name))
            suffix = f"-dp{replica}" if args.dp_size > 1 else ""
            tp = tp_config(rconfig, replica, 0)
            schedulers.append(f"scheduler{suffix}")
            entry = functools.partial(run_scheduler_process, heartbeat=heartbeats[replica], tp=tp)
            children.append((schedulers[-1], entry, rconfig))
            children += [(name, target, rconfig) for name, target in tp_worker_children(rconfig, replica, 0)]
            shards = rconfig.settings.grammar_shards
            children += [
                (worker_name(i, shards) + suffix, functools.partial(run_grammar_worker, shard=i), rconfig)
                for i in range(shards)
            ]
        for name, target, child_config in children:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_entry, args=(target, child_config, writer), name=name)
            proc.start()
            procs[name], pipes[name] = proc, reader
        for name, _, _ in children:
            if name not in schedulers:
                _wait_ready(name, procs[name], pipes[name])
        ready = [_wait_ready(name, procs[name], pipes[name]) for name in schedulers]
        return EngineProcesses(config, tokenizer, ready[0]["runner"], health, procs, ipc_dir, shms)
    except BaseException:
        _stop_processes(procs)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for shm in shms:
            shm.close()
            shm.unlink()
        raise


def run_follower_node(args: ServerArgs) -> int:
    """A host other than node 0 (`--node-rank` > 0): start its tensor-parallel ranks, wait while they serve node 0's
    steps, and exit when they do (node 0 stopped) or on SIGTERM / Ctrl-C. It runs no HTTP server, tokenizer,
    detokenizer or grammar process; its arguments must match node 0's."""
    set_nccl_environment()
    settings = resolve_settings(args)
    check_devices(args, settings)
    model_cfg = ModelConfig.from_dict(load_config_dict(resolve_model(args.model_path, args.load_format)[0]))
    launch = LaunchInfo(vocab_size=model_cfg.vocab_size, dist_init_methods=dist_init_methods(args))
    config = ServerConfig(args, settings, launch)
    ctx = mp.get_context("spawn")
    procs, pipes = {}, {}

    def on_sigterm(_signum, _frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for name, target in tp_worker_children(config, 0, args.node_rank):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_entry, args=(target, config, writer), name=name)
            proc.start()
            procs[name], pipes[name] = proc, reader
        logger.info("node %d of %d: tensor-parallel ranks %s joining %s", args.node_rank, args.nnodes,
                    ", ".join(procs), args.dist_init_addr)  # fmt: skip
        for name, proc in procs.items():
            _wait_ready(name, proc, pipes[name], timeout=1800)
        logger.info("node %d ready; serving node 0's steps", args.node_rank)
        while all(proc.is_alive() for proc in procs.values()):
            time.sleep(0.5)
        codes = {name: proc.exitcode for name, proc in procs.items() if not proc.is_alive()}
        logger.info("rank process ended %s; node %d stops", codes, args.node_rank)
        return 0 if all(code == 0 for code in codes.values()) else 1
    except KeyboardInterrupt:
        return 0
    finally:
        _stop_processes(procs)


def _stop_processes(procs: dict[str, mp.Process]) -> None:
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
    for proc in procs.values():
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
