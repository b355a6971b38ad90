"""Start the server: resolve the settings, derive the launch record, start the scheduler, detokenizer and grammar
worker processes, then the HTTP server in this process.

Start-up waits until the scheduler has loaded the model. If a child process dies, the requests in flight fail with
a 503 at once, /health turns 503, and the server exits non-zero. On Ctrl-C / SIGTERM the server drains: new
requests get a 503, running ones may finish for `--shutdown-timeout` seconds, the rest then fail with a 503; the
children are stopped too (and they exit on their own if we vanish). A second signal stops at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import uvicorn

from gramserve.config import LaunchInfo, ServerArgs, ServerConfig, Settings
from gramserve.detokenizer.process import run_detokenizer_process
from gramserve.grammar.grammar_shm import create_grammar_shm
from gramserve.grammar.worker import run_grammar_worker, worker_name
from gramserve.model.loader import default_tokenizer_dir, load_config_dict, resolve_model
from gramserve.model.model_config import ModelConfig
from gramserve.scheduler.process import run_scheduler_process
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


def _child_entry(target, config: ServerConfig, pipe) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    target(config, pipe)


def _wait_ready(name: str, proc: mp.Process, pipe, timeout: float = 600.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pipe.poll(0.5):
            msg = pipe.recv()
            if isinstance(msg, dict) and "error" in msg:
                raise StartupError(f"{name} failed to start: {msg['error']}")
            return msg
        if not proc.is_alive():
            raise StartupError(f"{name} process died during start-up (exit code {proc.exitcode})")
    raise StartupError(f"{name} did not become ready in {timeout:.0f} s")


def describe_settings(settings: Settings) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.to_dict().items())


def derive_launch_info(args: ServerArgs, tokenizer_dir: str, ipc_dir: str, tokenizer) -> LaunchInfo:
    """What the child processes need besides the arguments: the tokenizer folder, the vocabulary, EOS ids and
    the resolved parsers (the grammar shared memory's name is added once it exists)."""
    model_cfg = ModelConfig.from_dict(load_config_dict(resolve_model(args.model_path, args.load_format)[0]))
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


def launch_server(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [main] %(levelname)s %(message)s")
    ipc_dir = tempfile.mkdtemp(prefix="gramserve-ipc-")
    ctx = mp.get_context("spawn")
    procs: dict[str, mp.Process] = {}
    shm = None
    try:
        from transformers import AutoTokenizer

        settings = resolve_settings(args)
        logger.info("settings: %s", describe_settings(settings))
        tokenizer_dir = tokenizer_dir_for(args)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if args.chat_template:
            tokenizer.chat_template = read_chat_template(args.chat_template)
        launch = derive_launch_info(args, tokenizer_dir, ipc_dir, tokenizer)
        shm = create_grammar_shm(settings.max_running_requests, launch.vocab_size)
        config = ServerConfig(args, settings, dataclasses.replace(launch, grammar_shm=shm.name))
        pipes = {}
        heartbeat = ctx.Value("d", 0.0, lock=False)  # the scheduler loop's last time.monotonic() (health.py)
        health = ServerHealth(heartbeat, args.watchdog_timeout, warming=not args.skip_warmup)
        children = [
            ("scheduler", functools.partial(run_scheduler_process, heartbeat=heartbeat)),
            ("detokenizer", run_detokenizer_process),
        ]
        children += [
            (worker_name(i, settings.grammar_shards), functools.partial(run_grammar_worker, shard=i))
            for i in range(settings.grammar_shards)
        ]
        for name, target in children:
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child_entry, args=(target, config, writer), name=name)
            proc.start()
            procs[name], pipes[name] = proc, reader
        for name, _ in children[1:]:
            _wait_ready(name, procs[name], pipes[name])
        ready = _wait_ready("scheduler", procs["scheduler"], pipes["scheduler"])
        runner_info = ready["runner"]
        return _serve(config, tokenizer, runner_info, procs, health)
    except (StartupError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        if shm is not None:
            shm.close()
            shm.unlink()


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its shutdown, which would skip stopping our children."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def startup_summary(config: ServerConfig, runner_info: dict) -> str:
    args, settings = config.args, config.settings
    parts = [
        f"model {args.model_name}",
        f"{settings.device} {settings.dtype}",
        f"attention {settings.attention_backend}",
        f"KV pool {runner_info['max_total_tokens']} tokens",
        f"context {runner_info['context_length']}",
        f"max running {settings.max_running_requests}",
        f"grammar {args.grammar_backend} ({settings.grammar_shards} workers)",
        f"tool calls {config.launch.tool_call_parser}",
        f"reasoning {args.reasoning_parser or 'off'}",
        f"API key {'on' if args.api_key else 'off'}",
    ]
    return f"serving on http://{args.host}:{args.port}: " + ", ".join(parts)


FLUSH_S = 1.0  # after failing the requests in flight: time for their error answers to reach the clients


def _serve(
    config: ServerConfig, tokenizer, runner_info: dict, procs: dict[str, mp.Process], health: ServerHealth
) -> int:
    from gramserve.server.app import create_app
    from gramserve.server.metrics import RequestMetrics
    from gramserve.server.tokenizer_manager import TokenizerManager

    args = config.args
    metrics = RequestMetrics(args.model_name)
    tm = TokenizerManager(config, tokenizer, runner_info["context_length"], runner_info["vocab_size"], health, metrics)
    app = create_app(config, tm, runner_info)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=False,  # server/request_id.py writes one with the request id and the latency
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
        )
    )
    dead: list[str] = []

    def drain() -> None:
        deadline = time.monotonic() + args.shutdown_timeout
        while tm.in_flight and time.monotonic() < deadline and not server.should_exit:
            time.sleep(0.1)
        if tm.in_flight:
            logger.warning("shutdown: failing %d requests still running", tm.in_flight)
            tm.fail_all_threadsafe("the server is shutting down")
            time.sleep(FLUSH_S)
        server.should_exit = True

    def on_signal(signum, _frame) -> None:
        if health.draining:  # second signal: stop waiting for in-flight requests
            logger.info("received %s again; stopping now", signal.Signals(signum).name)
            server.should_exit = server.force_exit = True
            return
        logger.info(
            "received %s; draining (%d requests in flight, up to %.0f s)",
            signal.Signals(signum).name,
            tm.in_flight,
            args.shutdown_timeout,
        )
        health.draining = True
        threading.Thread(target=drain, name="drain", daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def watchdog() -> None:
        while not server.should_exit:
            for name, proc in procs.items():
                if not proc.is_alive():
                    logger.error("%s process died (exit code %s); shutting down", name, proc.exitcode)
                    dead.append(name)
                    health.dead_child = name
                    tm.fail_all_threadsafe(health.problem())
                    time.sleep(FLUSH_S)
                    server.should_exit = True
                    return
            time.sleep(0.5)

    threading.Thread(target=watchdog, name="child-watchdog", daemon=True).start()
    logger.info("%s", startup_summary(config, runner_info))
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        logger.warning(
            "listening on %s without an API key: anyone who can reach this port can use the server "
            "(--api-key or GRAMSERVE_API_KEY)",
            args.host,
        )
    server.run()
    if dead:
        return 1
    return 0 if server.started else 1


def main(args: ServerArgs) -> None:
    sys.exit(launch_server(args))
