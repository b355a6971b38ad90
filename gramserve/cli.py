"""Command line: `gramserve serve [--model PATH] [--port N] ...`."""

from __future__ import annotations

import argparse

from gramserve.config import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gramserve", description="Structured-generation LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model path (same as --model)")
    ServerArgs.add_cli_args(serve)
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        if ns.model_pos and not ns.model_path:
            ns.model_path = ns.model_pos
        from gramserve.server.launch import main as launch_main

        try:
            args = ServerArgs.from_cli_args(ns)
        except ValueError as exc:  # a combination argparse cannot check alone: a usage error, exit status 2
            serve.error(str(exc))
        launch_main(args)


if __name__ == "__main__":
    main()
