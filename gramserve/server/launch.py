"""Start the HTTP server: the engine's processes (processes.py), then the FastAPI app in this process.

Start-up waits until the scheduler has loaded the model. If a child process dies, the requests in flight fail with
a 503 at once, /health turns 503, and the server exits non-zero. On Ctrl-C / SIGTERM the server drains: new
requests get a 503, running ones may finish for `--shutdown-timeout` seconds, the rest then fail with a 503; the
children are stopped too (and they exit on their own if we vanish). A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time

import uvicorn

from gramserve.config import ServerArgs, ServerConfig
from gramserve.model.loader import ModelNotFoundError
from gramserve.model.lora.adapter import LoRAAdapterError
from gramserve.server.processes import EngineProcesses, StartupError, run_follower_node, start_engine_processes

logger = logging.getLogger("gramserve")
GIL_SWITCH_S = 0.0005  # see _serve


def launch_server(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s [main] %(levelname)s %(message)s")
    if args.node_rank > 0:  # multi-node: this host runs only its tensor-parallel ranks
        try:
            return run_follower_node(args)
        except (StartupError, ValueError) as exc:
            logger.error("%s", exc)
            return 1
    try:
        listeners = bind_listeners(args.host, args.port)  # before the model loads: a busy port fails in a second
    except OSError as exc:
        print(f"gramserve serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            engine = start_engine_processes(args)
        except (StartupError, ValueError) as exc:
            logger.error("%s", exc)
            return 1
        try:
            return _serve(engine, listeners)
        finally:
            engine.stop()
    finally:
        for sock in listeners:
            sock.close()


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, listening (connections wait in the backlog until the engine is up and uvicorn serves
    them): one per address the host resolves to, as asyncio's create_server binds them ("" or "0.0.0.0" / "::"
    for every interface)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, address) for family, _, _, _, address in infos))
    socks: list[socket.socket] = []
    try:
        for family, address in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: no wait for TIME_WAIT
            if family == socket.AF_INET6:  # as asyncio: "::" beside "0.0.0.0" must not take IPv4 too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            # Listening now, not once the model is loaded: a bound socket that does not listen leaves the port to
            # a second server with SO_REUSEADDR (both would load, and one fail at the end).
            sock.listen(2048)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its shutdown, which would skip stopping our children."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        lifespan = getattr(self, "lifespan", None)
        if self.force_exit and lifespan is not None and not lifespan.shutdown_event.is_set():
            # A forced exit (a second signal) skips the app's shutdown in uvicorn; the lifespan task then ends
            # cancelled with the loop and logs a traceback. Run it, briefly.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(lifespan.shutdown(), FORCED_SHUTDOWN_S)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def startup_summary(config: ServerConfig, runner_info: dict, port: int | None = None) -> str:
    """The start-up log line; `port`: the one listened on (--port 0 picks one)."""
    args, settings = config.args, config.settings
    parts = [
        f"model {args.model_name}",
        f"{settings.device} {settings.dtype}",
        f"attention {settings.attention_backend}",
        f"KV pool {runner_info['max_total_tokens']} tokens",
        f"context {runner_info['context_length']}",
        f"max running {settings.max_running_requests}",
        f"grammar {args.grammar_backend} ({settings.grammar_shards} workers)",
    ]
    if args.tp_size > 1 or args.dp_size > 1:  # KV pool and max running are each replica's; workers all replicas'
        parts.append(f"tensor parallel {args.tp_size} x data parallel {args.dp_size} ({args.load_balance_method})")
    parts += [
        f"tool calls {config.launch.tool_call_parser}",
        f"reasoning {args.reasoning_parser or 'off'}",
        f"API key {'on' if args.api_key else 'off'}",
    ]
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"serving on http://{host}:{args.port if port is None else port}: " + ", ".join(parts)


FORCED_SHUTDOWN_S = 2.0  # the app's own shutdown on a forced exit
FLUSH_S = 1.0  # after failing the requests in flight: time for their error answers to reach the clients


def _serve(engine: EngineProcesses, listeners: list[socket.socket]) -> int:
    from gramserve.server.app import create_app
    from gramserve.server.metrics import RequestMetrics
    from gramserve.server.tokenizer_manager import TokenizerManager

    config, runner_info, health = engine.config, engine.runner_info, engine.health
    args = config.args
    # The last checks and request preparation run on threads, in pure Python; at the default 5 ms switch interval
    # the event loop, which streams every request, waited up to 5 ms for the GIL behind one of them.
    sys.setswitchinterval(GIL_SWITCH_S)
    metrics = RequestMetrics(args.model_name)
    tm = TokenizerManager(
        config, engine.tokenizer, runner_info["context_length"], runner_info["vocab_size"], health, metrics
    )
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

    def on_child_death(_name: str) -> None:
        dead.append(_name)
        tm.fail_all_threadsafe(health.problem())
        time.sleep(FLUSH_S)
        server.should_exit = True

    engine.watch(on_child_death, lambda: server.should_exit)
    logger.info("%s", startup_summary(config, runner_info, listeners[0].getsockname()[1]))
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        logger.warning(
            "listening on %s without an API key: anyone who can reach this port can use the server "
            "(--api-key or GRAMSERVE_API_KEY)",
            args.host,
        )
    server.run(sockets=listeners)
    if dead:
        return 1
    return 0 if server.started else 1


def main(args: ServerArgs) -> None:
    try:
        sys.exit(launch_server(args))
    except (ModelNotFoundError, LoRAAdapterError) as exc:  # what the user gave: its message, not a traceback
        print(f"gramserve serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
