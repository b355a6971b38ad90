"""Command line: `gramserve serve [--model PATH] [--port N] ...` and
`gramserve extract --schema S --input I --output O [...]`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys

from gramserve.config import ServerArgs


def add_extract_args(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("extraction job")
    job.add_argument("--schema", required=True, help="the JSON schema every document's object must follow")
    job.add_argument("--input", required=True, help="JSON Lines (one object per document) or a folder of .txt/.md")
    job.add_argument("--output", required=True, help="JSON Lines, one line per document; a re-run resumes it")
    job.add_argument("--field", dest="text_field", default="text", help="the JSON Lines field holding the text")
    job.add_argument("--id-field", default="id", help="the JSON Lines field holding the id (default: line-N)")
    job.add_argument(
        "--prompt-template", default=None, help="a Jinja file for the user message (text, id, doc, schema)"
    )
    job.add_argument("--system-prompt", default=None, help="the system message ({schema} is replaced; '' for none)")
    job.add_argument("--max-tokens", type=int, default=1024, help="output tokens per document (default 1024)")
    job.add_argument("--temperature", type=float, default=0.0)
    job.add_argument("--concurrency", type=int, default=None, help="documents in flight (default: max running)")
    job.add_argument("--retry-failed", action="store_true", help="run the documents whose lines say error again")
    job.add_argument("--limit", type=int, default=None, help="only the first N documents")
    job.add_argument("--summary-json", default=None, help="also write the summary as JSON to this file")
    job.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run_extract(ns: argparse.Namespace, args: ServerArgs) -> int:
    from gramserve.engine import Engine
    from gramserve.extract.job import ExtractConfig, ExtractionJob

    names = {f.name for f in dataclasses.fields(ExtractConfig)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    config = ExtractConfig(schema_path=ns.schema, input_path=ns.input, output_path=ns.output, **values)
    engine_args = {k: v for k, v in dataclasses.asdict(args).items() if k != "model_path"}
    try:
        job = ExtractionJob(config)  # the schema and the template are checked before the model loads
    except (OSError, ValueError) as exc:
        print(f"gramserve extract: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the results written so far stay, the engine stops
    try:
        with Engine(args.model_path, **engine_args) as engine:
            summary = job.run(engine)
    except KeyboardInterrupt:
        print(
            f"gramserve extract: interrupted; the results written so far are in {ns.output}: "
            "the same command again goes on from there",
            file=sys.stderr,
        )
        return 128 + _interrupted_by[-1]  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM
    print(summary.text(), file=sys.stderr)
    if ns.summary_json:
        with open(ns.summary_json, "w") as f:
            json.dump(summary.to_dict(), f, indent=2)
    nothing_extracted = summary.done == 0 and summary.failed > 0
    return 1 if summary.invalid or nothing_extracted else 0


_interrupted_by = [signal.SIGINT]


def _interrupt(signum, _frame) -> None:
    _interrupted_by.append(signum)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gramserve", description="Structured-generation LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="model path (same as --model)")
    ServerArgs.add_cli_args(serve)
    extract = sub.add_parser("extract", help="extract JSON from many documents with a schema (in-process, no server)")
    add_extract_args(extract)
    ServerArgs.add_cli_args(extract)
    extract.set_defaults(log_level="warning")
    ns = parser.parse_args(argv)
    command = serve if ns.command == "serve" else extract
    if getattr(ns, "model_pos", None) and not ns.model_path:
        ns.model_path = ns.model_pos
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as exc:  # a combination argparse cannot check alone: a usage error, exit status 2
        command.error(str(exc))
    if ns.command == "serve":
        from gramserve.server.launch import main as launch_main

        launch_main(args)
    else:
        sys.exit(run_extract(ns, args))


if __name__ == "__main__":
    main()
