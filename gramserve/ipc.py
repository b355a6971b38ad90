"""ZeroMQ plumbing shared by the processes: socket helpers and the child-process watchdog.

Every channel is one-way PUSH -> PULL over an ipc:// socket in the server's private temp dir;
messages are the pickled dataclasses of gramserve.messages.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq
import zmq.asyncio

# Endpoint names (files inside LaunchInfo.ipc_dir).
SCHEDULER_IN = "scheduler"
DETOKENIZER_IN = "detokenizer"
TOKENIZER_MANAGER_IN = "tokenizer_manager"
SCHEDULER_GRAMMAR_IN = "scheduler_grammar"  # the scheduler's second inbox: grammar replies only


def grammar_inbox(shard: int) -> str:
    """The inbox of grammar worker `shard` (0 .. Settings.grammar_shards - 1)."""
    return f"grammar{shard}"


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def exit_when_parent_dies(poll_s: float = 1.0) -> None:
    """Child processes call this so that a killed server leaves no orphan behind."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                logging.getLogger(__name__).warning("parent process %d is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
