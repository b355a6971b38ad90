"""CPU suite: HF transformers ``generate`` (batch 1) vs gramserve at several concurrencies, in one run.

Steps, strictly one after the other (never two models loaded at once):

1. ``bench_hf_generate.py --batch-size 1`` as a subprocess: the baseline, output tok/s of one stream.
2. ``python -m gramserve serve`` on a free port (log to a file), wait for ``GET /health`` == 200, then
   ``bench_serving.py`` once per ``--concurrencies`` value (``--max-concurrency c``, all requests sent at
   once, fixed lengths, temperature 0, ``ignore_eos``), then SIGTERM the server and wait for it.
3. A markdown table (printed last, and written to ``--output-dir`` next to every raw JSON and the
   server log): output tok/s, ratio vs HF batch 1, TTFT p50, TPOT p50, ITL p99.

Example::

    python benchmarks/run_cpu_suite.py --concurrencies "1 16" \\
        --random-input-len 128 --random-output-len 128 \\
        --server-args "--dtype bfloat16" --label "bf16"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)


# --------------------------------------------------------------------------- machine


def cpu_info() -> dict[str, Any]:
    model, physical = None, set()
    phys_id = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "model name" and model is None:
                    model = val
                elif key == "physical id":
                    phys_id = val
                elif key == "core id":
                    physical.add((phys_id, val))
    except OSError:
        pass
    try:
        affinity: Optional[int] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": len(physical) or None,
        "usable_cpus": affinity,
        "load_avg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


# --------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(base_url: str) -> bool:
    try:
        with _NO_PROXY.open(base_url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class Server:
    def __init__(self, server_args: list[str], port: int, log_path: str):
        self.cmd = [
            sys.executable,
            "-m",
            "gramserve",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *server_args,
        ]
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None
        self.exit_code: Optional[int] = None
        self.sent_sigterm = False

    def start(self, timeout: float) -> None:
        print(f"[suite] starting server: {shlex.join(self.cmd)}  (log: {self.log_path})", file=sys.stderr, flush=True)
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        # Own session, so that a server stuck in shutdown can be killed with its children (and only them).
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} during start-up; log tail:\n{tail(self.log_path)}"
                )
            if healthy(self.base_url):
                self.startup_s = time.perf_counter() - t0
                print(f"[suite] server healthy after {self.startup_s:.1f} s", file=sys.stderr, flush=True)
                return
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s; log tail:\n{tail(self.log_path)}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            print("[suite] stopping server (SIGTERM)", file=sys.stderr, flush=True)
            self.proc.send_signal(signal.SIGTERM)
            self.sent_sigterm = True
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"[suite] server still up after {timeout:.0f} s; killing its process group", file=sys.stderr)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        # Children (scheduler, detokenizer) are in the same session; make sure none outlives the server.
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            pass
        else:
            time.sleep(2)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                print("[suite] killed leftover server child processes", file=sys.stderr)
            except ProcessLookupError:
                pass
        self.exit_code = self.proc.returncode
        self._log.close()
        self.proc = None


# --------------------------------------------------------------------------- runs


def run_child(cmd: list[str], timeout: Optional[float]) -> int:
    print(f"[suite] running: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        return subprocess.run(cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"[suite] timed out after {timeout:.0f} s", file=sys.stderr)
        return 124


def load_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def option_value(argv: list[str], name: str) -> Optional[str]:
    """Value of ``--name X`` or ``--name=X`` in an argument list (last one wins)."""
    val = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


# --------------------------------------------------------------------------- report


def fmt(v: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def build_markdown(meta: dict[str, Any], hf: Optional[dict[str, Any]], serving: list[dict[str, Any]]) -> str:
    m = meta["machine"]
    cores = f"{m['logical_cpus']} logical CPUs"
    if m.get("physical_cores"):
        cores += f" ({m['physical_cores']} physical cores)"
    if m.get("usable_cpus") and m["usable_cpus"] != m["logical_cpus"]:
        cores += f", {m['usable_cpus']} usable"
    load = m.get("load_avg_1_5_15")
    lines = [
        f"## gramserve CPU suite{' - ' + meta['label'] if meta['label'] else ''}",
        "",
        f"- machine: {m['cpu_model']}, {cores}; load avg at start "
        f"{' / '.join(f'{x:.2f}' for x in load) if load else 'n/a'}",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- workload: {meta['input_len']} input / {meta['output_len']} output tokens (fixed, random ids, "
        f"ignore_eos), temperature 0; server args: `{meta['server_args'] or '(none)'}`; "
        f"HF baseline: float32, {meta['hf_threads'] or 'all'} torch threads, {meta['hf_iters']} timed iters",
        "",
        "| run | output tok/s | vs HF batch 1 | TTFT p50 ms | TPOT p50 ms | ITL p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = hf["output_throughput"] if hf and hf.get("ok") else None
    if hf and hf.get("ok"):
        lines.append(
            f"| HF generate (batch 1) | {hf['output_throughput']:.1f} | 1.00x | "
            f"{fmt(hf.get('prefill_ms'))}* | {fmt(hf.get('decode_step_ms'), '.2f')}* | n/a |"
        )
    else:
        lines.append(f"| HF generate (batch 1) | FAILED (rc {hf.get('rc') if hf else '?'}) | | | | |")
    for s in serving:
        name = f"gramserve c={s['concurrency']} ({s['num_prompts']} req)"
        if s.get("not_run"):
            lines.append(f"| {name} | not run (server down) | | | | |")
            continue
        if not s.get("ok"):
            lines.append(f"| {name} | FAILED (rc {s.get('rc')}) | | | | |")
            continue
        ratio = f"{s['output_throughput'] / base:.2f}x" if base else "n/a"
        lines.append(
            f"| {name} | {s['output_throughput']:.1f} | {ratio} | {fmt(s['ttft_p50_ms'])} | "
            f"{fmt(s['tpot_p50_ms'], '.2f')} | {fmt(s['itl_p99_ms'], '.2f')} |"
        )
    lines.append("")
    lines.append(
        "\\* HF row: TTFT = median time of a 1-token `generate` (prefill); "
        "TPOT = (mean latency - prefill) / (output_len - 1). gramserve rows: streamed over HTTP."
    )
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def split_server_args(p: argparse.ArgumentParser, text: str) -> list[str]:
    """Parse --server-args; the benchmark picks host and port itself."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        p.error(f"--server-args: {e}")
    for bad in ("--port", "--host"):
        if option_value(argv, bad) is not None:
            p.error(f"--server-args must not set {bad} (a free local port is picked)")
    return argv


def output_prefix(output_dir: str, name: str, label: str | None, started: datetime) -> str:
    """`<output_dir>/<name>_<date-time>[_label]`, creating the folder."""
    run_id = started.strftime("%Y%m%d-%H%M%S")
    if label:
        run_id += "_" + "".join(c if c.isalnum() or c in "-_." else "-" for c in label)[:40]
    out_dir = os.path.abspath(output_dir)
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, f"{name}_{run_id}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--concurrencies", default="1 16", help="space/comma separated max-concurrency values")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests per concurrency (default: max(8, 4*concurrency))"
    )
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--server-args", default="", help='passed through to "gramserve serve", e.g. "--dtype bfloat16"')
    p.add_argument("--label", default="", help="free text, stored in the JSON and the table title")
    p.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--hf-iters", type=int, default=3, help="timed HF generate iterations (after one warmup)")
    p.add_argument(
        "--hf-model-dir",
        default=None,
        help="HF folder for the baseline (default: gramserve's default model, as the server)",
    )
    p.add_argument(
        "--hf-threads",
        type=int,
        default=None,
        help="torch threads of the baseline (default: the server's --num-threads, else all cores)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per benchmark subprocess")
    args = p.parse_args(argv)
    try:
        args.concurrency_list = [int(x) for x in args.concurrencies.replace(",", " ").split()]
    except ValueError:
        p.error('--concurrencies must be integers, e.g. "1 16"')
    if not args.concurrency_list or min(args.concurrency_list) < 1:
        p.error("--concurrencies needs at least one value >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.random_input_len < 1 or args.random_output_len < 1 or args.hf_iters < 1:
        p.error("lengths and --hf-iters must be >= 1")
    args.server_argv = split_server_args(p, args.server_args)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.now().astimezone()
    prefix = output_prefix(args.output_dir, "cpu_suite", args.label, started)
    run_id = os.path.basename(prefix).removeprefix("cpu_suite_")
    notes: list[str] = []

    server_threads = option_value(args.server_argv, "--num-threads")
    hf_threads = args.hf_threads or (int(server_threads) if server_threads and server_threads.isdigit() else None)
    dtype = option_value(args.server_argv, "--dtype")
    if dtype not in (None, "auto", "float32"):
        notes.append(f"server runs --dtype {dtype}, the HF baseline runs float32")
    if option_value(args.server_argv, "--model") or option_value(args.server_argv, "--model-path"):
        if not args.hf_model_dir:
            notes.append("server --model set but no --hf-model-dir: the HF baseline uses the default model")
    meta: dict[str, Any] = {
        "benchmark": "cpu_suite",
        "label": args.label,
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": cpu_info(),
        "input_len": args.random_input_len,
        "output_len": args.random_output_len,
        "server_args": args.server_args,
        "hf_threads": hf_threads,
        "hf_iters": args.hf_iters,
        "notes": notes,
    }
    py = sys.executable
    rc_all = 0

    # 1. HF transformers generate, batch 1 (runs alone; the server is not up yet).
    hf_json = prefix + "_hf_generate.json"
    cmd = [
        py,
        os.path.join(BENCH_DIR, "bench_hf_generate.py"),
        "--batch-size",
        "1",
        "--input-len",
        str(args.random_input_len),
        "--output-len",
        str(args.random_output_len),
        "--iters",
        str(args.hf_iters),
        "--seed",
        str(args.seed),
        "--output-json",
        hf_json,
        "--label",
        f"cpu_suite {run_id} hf batch 1",
    ]
    if args.hf_model_dir:
        cmd += ["--model-dir", args.hf_model_dir]
    if hf_threads:
        cmd += ["--threads", str(hf_threads)]
    rc = run_child(cmd, args.run_timeout)
    rec = load_json(hf_json) if rc == 0 else None
    hf: dict[str, Any] = {"rc": rc, "ok": False, "json": hf_json if rec else None}
    if rec and rec.get("results"):
        r = rec["results"][0]
        hf.update(
            ok=True,
            output_throughput=r["output_throughput"],
            prefill_ms=None if r.get("prefill_s") is None else r["prefill_s"] * 1000,
            decode_step_ms=r.get("decode_step_ms"),
            step_latency_ms=r.get("step_latency_ms"),
        )
        if not r.get("generated_lengths_ok", True):
            notes.append("HF generate did not produce exactly the asked output length")
    else:
        rc_all = 1

    # 2. gramserve at each concurrency (one server for all of them).
    serving: list[dict[str, Any]] = []
    server = Server(args.server_argv, free_port(), prefix + "_server.log")
    try:
        server.start(args.startup_timeout)
        for c in args.concurrency_list:
            n = args.num_prompts or max(8, 4 * c)
            out_json = prefix + f"_serving_c{c}.json"
            cmd = [
                py,
                os.path.join(BENCH_DIR, "bench_serving.py"),
                "--base-url",
                server.base_url,
                "--num-prompts",
                str(n),
                "--max-concurrency",
                str(c),
                "--request-rate",
                "inf",
                "--random-input-len",
                str(args.random_input_len),
                "--random-output-len",
                str(args.random_output_len),
                "--random-range-ratio",
                "1.0",
                "--temperature",
                "0",
                "--seed",
                str(args.seed),
                "--output-json",
                out_json,
                "--label",
                f"cpu_suite {run_id} c={c}",
            ]
            rc = run_child(cmd, args.run_timeout)
            rec = load_json(out_json) if rc == 0 else None
            row: dict[str, Any] = {
                "concurrency": c,
                "num_prompts": n,
                "rc": rc,
                "ok": False,
                "json": out_json if rec else None,
            }
            if rec:
                s = rec["summary"]
                row.update(
                    ok=True,
                    output_throughput=s["output_throughput"],
                    ttft_p50_ms=s["ttft_ms"]["median"],
                    tpot_p50_ms=s["tpot_ms"]["median"],
                    itl_p99_ms=s["itl_ms"]["p99"],
                    failed=s["failed"],
                    output_len_mismatches=s["output_len_mismatches"],
                    mean_concurrency=s["mean_concurrency"],
                )
                if s["failed"]:
                    notes.append(
                        f"c={c}: {s['failed']} of {s['num_prompts']} requests failed: "
                        f"{next(iter(s['errors']), '')[:120]}"
                    )
                if s["output_len_mismatches"]:
                    notes.append(f"c={c}: {s['output_len_mismatches']} requests had a different output length")
            else:
                rc_all = 1
            serving.append(row)
    except RuntimeError as e:
        print(f"[suite] error: {e}", file=sys.stderr)
        last = [ln for ln in tail(server.log_path, 5).splitlines() if ln.strip()]
        notes.append(
            str(e).splitlines()[0].replace("; log tail:", "")
            + (f"; last log line: `{last[-1].strip()[:200]}`" if last else "")
            + f" (log: {server.log_path})"
        )
        rc_all = 1
    finally:
        server.stop()
    meta["server"] = {
        "command": shlex.join(server.cmd),
        "log": server.log_path,
        "startup_s": server.startup_s,
        "exit_code": server.exit_code,
    }
    if server.sent_sigterm and server.exit_code not in (0, None):
        notes.append(f"server exited with code {server.exit_code} after SIGTERM")
    for c in args.concurrency_list[len(serving) :]:
        serving.append(
            {
                "concurrency": c,
                "num_prompts": args.num_prompts or max(8, 4 * c),
                "rc": None,
                "ok": False,
                "not_run": True,
            }
        )

    # 3. Report: markdown (printed last) + one JSON with everything, next to the raw files.
    md = build_markdown(meta, hf, serving)
    with open(prefix + ".md", "w") as f:
        f.write(md)
    suite = {
        **meta,
        "hf_generate": {**hf, "raw": load_json(hf_json)},
        "serving": [{**s, "raw": load_json(s["json"]) if s.get("json") else None} for s in serving],
    }
    with open(prefix + ".json", "w") as f:
        json.dump(suite, f, indent=2, default=str)
        f.write("\n")
    print(f"[suite] wrote {prefix}.md, {prefix}.json and the raw files {prefix}_*", file=sys.stderr, flush=True)
    print()
    print(md, end="", flush=True)
    return rc_all


if __name__ == "__main__":
    sys.exit(main())
