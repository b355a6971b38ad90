"""Tensor / data parallelism through HTTP: the same workloads on servers of different --tp-size / --dp-size.

For each setup (a name and the extra `gramserve serve` arguments) it starts the server, times the start until
/health answers 200, then runs bench_serving.py's workloads against it, one setup after the other on the same host:

* `decode`: one request at a time, 128 prompt tokens, 256 output tokens: TPOT at batch 1 (latency per token);
* `burst`: N requests at once (prompt uniform 0-400, output uniform 0-360 tokens, ignore_eos; issue 20's workload),
  run twice (the first warms the server); output tok/s, TTFT and TPOT.

The lengths and counts are options (smaller ones for a CPU).

Example (two GPUs, the 8B shape with dummy weights)::

    python benchmarks/bench_parallel.py --model-args "--model-path llama-3.1-8b.json --load-format dummy \\
        --tokenizer tok" --setup tp1= --setup "tp2=--tp-size 2" --setup "dp2=--dp-size 2" --output-dir out

Writes out/parallel.jsonl (one line per setup and workload, with bench_serving's full record) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))


def start(model_args: str, extra: str, port: int, log_path: str) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "gramserve", "serve", "--port", str(port), *shlex.split(model_args)]
    cmd += shlex.split(extra)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    while time.time() - t0 < 1200:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def bench(port: int, label: str, out: str, args: list[str]) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "bench_serving.py"), "--base-url", f"http://127.0.0.1:{port}"]
    cmd += ["--disable-progress", "--output-json", out, "--append", "--label", label, *args]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"bench_serving failed: {run.stderr[-2000:]}")
    with open(out) as f:
        return json.loads(f.read().splitlines()[-1])["summary"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-args", required=True, help="gramserve serve arguments shared by every setup")
    p.add_argument("--setup", action="append", required=True, help="NAME=EXTRA ARGS (repeat)")
    p.add_argument("--burst", type=int, default=1000, help="requests of the burst workload (0: skip it)")
    p.add_argument("--burst-runs", type=int, default=2, help="times the burst runs (the first warms the server)")
    p.add_argument("--decode-output-len", type=int, default=256)
    p.add_argument("--burst-input-len", type=int, default=400, help="prompts uniform 0..this")
    p.add_argument("--burst-output-len", type=int, default=360, help="outputs uniform 0..this")
    p.add_argument("--decode-prompts", type=int, default=8, help="requests of the batch-1 workload (0: skip it)")
    p.add_argument("--output-dir", default="benchmarks/results/parallel")
    p.add_argument("--port", type=int, default=30200)
    a = p.parse_args()
    os.makedirs(a.output_dir, exist_ok=True)
    out = os.path.join(a.output_dir, "parallel.jsonl")
    rows = []
    for setup in a.setup:
        name, _, extra = setup.partition("=")
        proc, ready_s = start(a.model_args, extra, a.port, os.path.join(a.output_dir, f"server-{name}.log"))
        try:
            row = {"setup": name, "args": extra, "ready_s": round(ready_s, 1)}
            if a.decode_prompts:
                s = bench(a.port, f"{name} decode", out, [
                    "--num-prompts", str(a.decode_prompts), "--max-concurrency", "1", "--random-input-len", "128",
                    "--random-output-len", str(a.decode_output_len), "--random-range-ratio", "1"])  # fmt: skip
                row["decode_tpot_ms"] = round(s["tpot_ms"]["mean"], 2)
            for run in range(1, a.burst_runs + 1) if a.burst else ():
                s = bench(a.port, f"{name} burst{run}", out, [
                    "--num-prompts", str(a.burst), "--random-input-len", str(a.burst_input_len),
                    "--random-output-len", str(a.burst_output_len),
                    "--random-range-ratio", "0", "--seed", str(run)])  # fmt: skip
                row[f"burst{run}_tok_s"] = round(s["output_throughput"])
                row[f"burst{run}_ttft_ms"] = round(s["ttft_ms"]["mean"])
                row[f"burst{run}_tpot_ms"] = round(s["tpot_ms"]["median"], 1)
                row[f"burst{run}_failed"] = s["failed"]
        finally:
            proc.terminate()
            proc.wait(120)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(a.output_dir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
