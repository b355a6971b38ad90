"""Online serving benchmark for an OpenAI-compatible server (gramserve or any other).

It sends random token-id prompts to ``POST /v1/completions`` with streaming and
``ignore_eos`` (so each output has exactly the asked length), under a chosen
concurrency limit and/or Poisson arrival rate, and measures per request:

* TTFT  - time to the first streamed chunk that carries text,
* ITL   - gaps between successive text chunks,
* TPOT  - (latency - TTFT) / (output_tokens - 1),
* E2E   - whole request latency,

then reports throughput (requests/s, output tokens/s, total tokens/s) and
mean/median/p90/p99 of each latency metric in ms. ``--output-json`` saves the
numbers with the arguments, command line, timestamp and machine info.

The client is aiohttp where it is installed (``--client``): parsing a streamed event costs httpx several times
the CPU, and at about 10,000 events/s one httpx event loop saturates its core and becomes what the benchmark
measures. The report says how much CPU the client used per output token.

The server must already be running, e.g.::

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 \\
        --num-prompts 200 --random-input-len 512 --random-output-len 128 \\
        --random-range-ratio 0.5 --max-concurrency 32 \\
        --output-json benchmarks/results/serving.jsonl --append --label "c32"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import shlex
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Optional

import httpx

try:
    import aiohttp
except ImportError:  # the benchmark still runs, on httpx
    aiohttp = None

# --------------------------------------------------------------------------- data


@dataclass
class RequestInput:
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    expected_output_len: int = 0
    output_tokens: int = 0
    num_chunks: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, request start to end of stream
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    start_time: float = 0.0  # seconds since benchmark start
    usage_reported: bool = False
    finish_reason: Optional[str] = None
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Stats:
    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0
    count: int = 0


@dataclass
class BenchmarkSummary:
    model: str
    base_url: str
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_expected_output_tokens: int
    output_len_mismatches: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    mean_concurrency: float  # sum of latencies / duration
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    errors: dict[str, int] = field(default_factory=dict)
    client: str = "httpx"
    client_cpu_s: float = 0.0  # this process's CPU time during the run: near duration_s, the client is the limit
    chunks: int = 0  # streamed events with text (a server may send several tokens in one)


# --------------------------------------------------------------------------- helpers


def percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated percentile (same as numpy's default), q in [0, 100]."""
    if not sorted_vals:
        return 0.0
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    frac = pos - lo
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * frac


def compute_stats(values_s: list[float]) -> Stats:
    """Stats of a list of seconds, returned in milliseconds."""
    vals = sorted(v * 1000.0 for v in values_s)
    if not vals:
        return Stats()
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / n)
    return Stats(
        mean=mean,
        median=percentile(vals, 50),
        p90=percentile(vals, 90),
        p99=percentile(vals, 99),
        std=std,
        min=vals[0],
        max=vals[-1],
        count=n,
    )


def sample_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_low: int,
    vocab_high: int,
    rng: random.Random,
) -> list[RequestInput]:
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1]")
    if vocab_high <= vocab_low:
        raise ValueError("--vocab-high must be larger than --vocab-low")
    reqs = []
    for _ in range(num):
        ilen = rng.randint(max(1, int(input_len * range_ratio)), max(1, input_len))
        olen = rng.randint(max(1, int(output_len * range_ratio)), max(1, output_len))
        ids = [rng.randrange(vocab_low, vocab_high) for _ in range(ilen)]
        reqs.append(RequestInput(prompt_ids=ids, output_len=olen))
    return reqs


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "httpx": httpx.__version__,
        "aiohttp": aiohttp.__version__ if aiohttp is not None else None,
    }


def _short_error(e: BaseException) -> str:
    msg = str(e) or repr(e)
    return f"{type(e).__name__}: {msg}"[:500]


# --------------------------------------------------------------------------- client


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the payload of each SSE ``data:`` event (multi-line events are joined)."""
    buf: list[str] = []
    async for line in lines:
        if line == "":
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue  # SSE comment / keep-alive
        if line.startswith("data:"):
            payload = line[5:]
            if payload.startswith(" "):
                payload = payload[1:]
            buf.append(payload)
    if buf:
        yield "\n".join(buf)


async def _aiohttp_lines(resp) -> AsyncIterator[str]:
    async for raw in resp.content:
        yield raw.decode("utf-8").rstrip("\r\n")


class Client:
    """Streams completions over aiohttp (`session`) or, where that is missing or `--client httpx`, httpx."""

    def __init__(self, args: argparse.Namespace, model: str, http: httpx.AsyncClient, session=None):
        self.args = args
        self.model = model
        self.http = http
        self.session = session
        self.url = args.base_url.rstrip("/") + "/v1/completions"
        self.extra_body = json.loads(args.extra_body) if args.extra_body else {}

    def payload(self, req: RequestInput) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt_ids,
            "max_tokens": req.output_len,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.args.disable_ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    async def send(self, req: RequestInput, bench_t0: float) -> RequestResult:
        res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len)
        st = time.perf_counter()
        res.start_time = st - bench_t0
        try:
            await asyncio.wait_for(self._stream(req, res, st), timeout=self.args.timeout)
        except asyncio.TimeoutError:
            res.success = False
            res.error = f"Timeout: request exceeded {self.args.timeout:g} s"
        except Exception as e:  # noqa: BLE001 - every failure is a data point
            res.success = False
            res.error = res.error or _short_error(e)
        if not res.success and not res.latency:
            res.latency = time.perf_counter() - st
        return res

    async def _stream(self, req: RequestInput, res: RequestResult, st: float) -> None:
        last_t = st
        text_chunks = 0
        usage_tokens: Optional[int] = None
        got_done = False
        async with self._open(req) as (status, error_body, lines):
            if status != 200:
                res.error = f"HTTP {status}: {error_body[:300]}"
                return
            async for data in iter_sse_data(lines):
                if data.strip() == "[DONE]":
                    got_done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    res.error = f"bad SSE payload: {data[:200]}"
                    return
                if isinstance(chunk, dict) and chunk.get("error"):
                    err = chunk["error"]
                    res.error = "stream error: " + (json.dumps(err) if not isinstance(err, str) else err)[:300]
                    return
                res.num_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    if usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        res.prompt_len = int(usage["prompt_tokens"])
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                    if choice.get("text"):
                        if text_chunks == 0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last_t)
                        last_t = now
                        text_chunks += 1
                        break  # n=1: one choice per chunk
        end = time.perf_counter()
        res.latency = end - st
        if usage_tokens is not None:
            res.output_tokens = usage_tokens
            res.usage_reported = True
        else:
            res.output_tokens = text_chunks
        if text_chunks == 0:
            res.error = "no text chunk received" + ("" if got_done else " (stream ended without [DONE])")
            return
        if not got_done and not self.args.allow_missing_done:
            res.error = "stream ended without data: [DONE]"
            return
        res.success = True

    def _open(self, req: RequestInput):
        return open_stream(self.url, self.payload(req), self.http, self.session)


@contextlib.asynccontextmanager
async def open_stream(url: str, body: dict[str, Any], http: httpx.AsyncClient, session=None, timeout=None):
    """POST a streamed request: (status, error body, the stream's lines), over aiohttp's `session` when given."""
    if session is not None:
        kwargs = {} if timeout is None else {"timeout": aiohttp.ClientTimeout(total=timeout)}
        async with session.post(url, json=body, **kwargs) as resp:
            if resp.status != 200:
                yield resp.status, (await resp.read()).decode("utf-8", "replace"), None
            else:
                yield 200, "", _aiohttp_lines(resp)
        return
    kwargs = {} if timeout is None else {"timeout": timeout}
    async with http.stream("POST", url, json=body, **kwargs) as resp:
        if resp.status_code != 200:
            yield resp.status_code, (await resp.aread()).decode("utf-8", "replace"), None
        else:
            yield 200, "", resp.aiter_lines()


def aiohttp_session(headers: dict | None = None, connect_timeout: float = 30.0):
    """An aiohttp session sized for thousands of concurrent streams (None where aiohttp is not installed)."""
    if aiohttp is None:
        return None
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        headers=headers,
        read_bufsize=1 << 20,
        trust_env=False,
    )


async def fetch_model(http: httpx.AsyncClient, base_url: str) -> str:
    r = await http.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models returned no models")
    return data[0]["id"]


async def arrivals(reqs: list[RequestInput], rate: float, rng: random.Random) -> AsyncIterator[RequestInput]:
    """Yield requests with exponential inter-arrival gaps (Poisson process at `rate` req/s)."""
    for i, r in enumerate(reqs):
        yield r
        if math.isinf(rate) or i == len(reqs) - 1:
            continue
        await asyncio.sleep(rng.expovariate(rate))


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.failed, self.enabled = total, 0, 0, enabled
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= 1.0 or self.done == self.total:
            self._last = now
            end = "\n" if self.done == self.total else ""
            print(
                f"\r  {self.done}/{self.total} done, {self.failed} failed, {now - self.t0:.1f} s",
                end=end,
                file=sys.stderr,
                flush=True,
            )


async def run_benchmark(args: argparse.Namespace) -> tuple[BenchmarkSummary, list[RequestResult]]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers, trust_env=False) as http,
        contextlib.AsyncExitStack() as closing,
    ):
        model = args.model or await fetch_model(http, args.base_url)
        reqs = sample_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.vocab_low,
            args.vocab_high,
            rng,
        )
        warm = sample_requests(
            args.warmup_requests,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.vocab_low,
            args.vocab_high,
            random.Random(args.seed + 1),
        )
        session = aiohttp_session(headers, min(args.timeout, 30.0)) if args.client == "aiohttp" else None
        if session is not None:
            closing.push_async_callback(session.close)
        client = Client(args, model, http, session)

        if warm:
            print(f"warmup: {len(warm)} request(s) ...", file=sys.stderr)
            wres = await asyncio.gather(*(client.send(r, time.perf_counter()) for r in warm))
            bad = [r for r in wres if not r.success]
            if bad:
                msg = f"warmup failed: {bad[0].error}"
                if not args.ignore_warmup_failure:
                    raise RuntimeError(msg + " (use --ignore-warmup-failure to go on)")
                print(msg, file=sys.stderr)

        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        progress = Progress(len(reqs), not args.disable_progress)
        arrival_rng = random.Random(args.seed + 2)

        async def one(r: RequestInput, t0: float) -> RequestResult:
            if sem is None:
                res = await client.send(r, t0)
            else:
                async with sem:
                    res = await client.send(r, t0)
            progress.update(res.success)
            return res

        print(
            f"benchmark: {len(reqs)} requests, model={model}, rate={args.request_rate}, "
            f"max_concurrency={args.max_concurrency or 'unlimited'}",
            file=sys.stderr,
        )
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        progress.t0 = t0
        tasks = []
        async for r in arrivals(reqs, args.request_rate, arrival_rng):
            tasks.append(asyncio.create_task(one(r, t0)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        cpu = time.process_time() - cpu0

    summary = summarize(args, model, results, duration)
    return dataclasses.replace(summary, client=args.client, client_cpu_s=cpu), results


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> BenchmarkSummary:
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    tin = sum(r.prompt_len for r in ok)
    tout = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    return BenchmarkSummary(
        model=model,
        base_url=args.base_url,
        num_prompts=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        total_input_tokens=tin,
        total_output_tokens=tout,
        total_expected_output_tokens=sum(r.expected_output_len for r in ok),
        output_len_mismatches=sum(1 for r in ok if r.output_tokens != r.expected_output_len),
        request_throughput=len(ok) / dur,
        output_throughput=tout / dur,
        total_token_throughput=(tin + tout) / dur,
        mean_concurrency=sum(r.latency for r in ok) / dur,
        ttft_ms=compute_stats([r.ttft for r in ok]),
        tpot_ms=compute_stats([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=compute_stats([g for r in ok for g in r.itl]),
        e2e_ms=compute_stats([r.latency for r in ok]),
        errors=errors,
        chunks=sum(len(r.itl) + 1 for r in ok),
    )


# --------------------------------------------------------------------------- report


def format_report(s: BenchmarkSummary, args: argparse.Namespace) -> str:
    w = 50
    lines = ["", " Serving Benchmark Result ".center(w, "=")]

    def row(k: str, v: Any) -> None:
        if isinstance(v, float):
            v = f"{v:.2f}"
        lines.append(f"{k:<34}{v!s:>16}")

    row("Model:", s.model if len(s.model) <= 16 else "..." + s.model[-13:])
    row("Request rate (req/s):", "inf" if math.isinf(args.request_rate) else args.request_rate)
    row("Max concurrency:", args.max_concurrency or "unlimited")
    row("Successful requests:", s.completed)
    row("Failed requests:", s.failed)
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens)
    row("Total output tokens:", s.total_output_tokens)
    if s.output_len_mismatches:
        row("Output length mismatches:", s.output_len_mismatches)
    row("Request throughput (req/s):", s.request_throughput)
    row("Output token throughput (tok/s):", s.output_throughput)
    row("Total token throughput (tok/s):", s.total_token_throughput)
    row("Mean concurrency:", s.mean_concurrency)
    header = f"{'(ms)':<8}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}"
    lines.append("-" * w)
    lines.append(header)
    for name, st in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        lines.append(f"{name:<8}{st.mean:>10.2f}{st.median:>10.2f}{st.p90:>10.2f}{st.p99:>10.2f}")
    lines.append("-" * w)
    per_token = s.client_cpu_s / max(s.total_output_tokens, 1) * 1e6
    lines.append(f"client {s.client}: {s.client_cpu_s:.1f} CPU s ({per_token:.0f} us/token), {s.chunks} text chunks")
    lines.append("=" * w)
    if s.errors:
        lines.append("Errors:")
        for err, n in sorted(s.errors.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  [{n}x] {err}")
    return "\n".join(lines)


def write_json(path: str, record: dict[str, Any], append: bool) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    if append:
        with open(path, "a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
    else:
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=_json_default)
            f.write("\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    return str(o)


def _jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        out[k] = "inf" if isinstance(v, float) and math.isinf(v) else v
    return out


def build_record(args: argparse.Namespace, s: BenchmarkSummary, results: list[RequestResult]) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "benchmark": "serving",
        "label": args.label,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": _jsonable_args(args),
        "machine": machine_info(),
        "summary": dataclasses.asdict(s),
    }
    if args.save_requests:
        rec["requests"] = [
            {
                "success": r.success,
                "prompt_len": r.prompt_len,
                "expected_output_len": r.expected_output_len,
                "output_tokens": r.output_tokens,
                "start_time_s": r.start_time,
                "ttft_ms": r.ttft * 1000,
                "latency_ms": r.latency * 1000,
                "tpot_ms": None if r.tpot is None else r.tpot * 1000,
                "itl_ms": [g * 1000 for g in r.itl],
                "finish_reason": r.finish_reason,
                "error": r.error,
            }
            for r in results
        ]
    return rec


# --------------------------------------------------------------------------- cli


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name; default: first entry of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token, if the server wants one")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio", type=float, default=1.0, help="lengths uniform in [len*ratio, len]; 1.0 = fixed lengths"
    )
    p.add_argument("--vocab-low", type=int, default=100, help="lowest random token id (skips special tokens)")
    p.add_argument("--vocab-high", type=int, default=40000, help="random token ids are < this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrival rate in req/s; inf sends all at once"
    )
    p.add_argument("--warmup-requests", type=int, default=1, help="sent first, not counted")
    p.add_argument("--ignore-warmup-failure", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--disable-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument(
        "--allow-missing-done", action="store_true", help="count a stream that ends without data: [DONE] as a success"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--append", action="store_true", help="append one JSON line per run (use a .jsonl path)")
    p.add_argument("--save-requests", action="store_true", help="also store per-request numbers in the JSON")
    p.add_argument("--label", default="", help="free text stored in the JSON")
    p.add_argument("--disable-progress", action="store_true")
    p.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp" if aiohttp is not None else "httpx",
        help="HTTP client library (aiohttp costs less CPU per streamed event)",
    )
    args = p.parse_args(argv)
    if args.client == "aiohttp" and aiohttp is None:
        p.error("--client aiohttp: aiohttp is not installed")
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.extra_body:
        try:
            if not isinstance(json.loads(args.extra_body), dict):
                raise ValueError
        except ValueError:
            p.error("--extra-body must be a JSON object")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        summary, results = asyncio.run(run_benchmark(args))
    except (httpx.HTTPError, RuntimeError, OSError) as e:
        print(f"error: {_short_error(e)}", file=sys.stderr)
        return 2
    print(format_report(summary, args))
    if args.output_json:
        write_json(args.output_json, build_record(args, summary, results), args.append)
        print(f"results {'appended to' if args.append else 'written to'} {args.output_json}")
    return 0 if summary.completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
