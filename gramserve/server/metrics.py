"""Prometheus metrics for GET /metrics, named in vLLM's style with a `gramserve:` prefix.

Two sources, one exposition (prometheus-client's text format and metric families):
- Request metrics live in the main process, which sees every request from arrival to its last token (TTFT,
  inter-token latency, end-to-end latency, token counters, finish reasons, refusals, failures): `RequestMetrics`.
  They are recorded on the event loop for every output message of every request, where each microsecond shows in
  the throughput of a busy server, so they are plain counts (one thread: no locks), turned into metric families
  only when /metrics is read.
- Scheduler and grammar metrics (running / queued requests, KV use, prefix-cache hits, grammar compile and fill
  histograms, cache hits) are read from the scheduler at scrape time, from the same report as /get_server_info,
  and turned into metric families (`scheduler_families`). No metric files are shared between processes.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

PREFIX = "gramserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; vLLM's buckets for the same histograms, so dashboards built for them read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


def refusal_reason(message: str) -> str:
    """A grammar refusal's message, reduced to a label of few values."""
    low = message.lower()
    if "time" in low and "out" in low:
        return "compile_timeout"
    if "unimplemented" in low or "unsupported" in low or "not supported" in low:
        return "unsupported"
    return "invalid"


class SecondsHistogram:
    """Fixed buckets (upper bounds, inclusive, in seconds) and a sum; `observe(v, n)` counts n values of v."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n

    def family(self, name: str, doc: str, model: str) -> HistogramMetricFamily:
        buckets, running = [], 0
        for bound, count in zip([*(f"{b:g}" for b in self.bounds), "+Inf"], self.counts):
            running += count
            buckets.append((bound, running))
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model], buckets, sum_value=self.total)
        return family


class RequestMetrics:
    """What the main process records per engine request (TokenizerManager calls these, on its event loop)."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: Counter[str] = Counter()  # by finish reason
        self.failure: Counter[str] = Counter()  # by reason
        self.constrained: Counter[str] = Counter()  # by grammar kind
        self.refusals: Counter[str] = Counter()  # by refusal_reason
        self.ttft = SecondsHistogram(TTFT_BUCKETS)
        self.itl = SecondsHistogram(ITL_BUCKETS)
        self.e2e = SecondsHistogram(E2E_BUCKETS)

    def started(self, grammar_kind: str | None) -> None:
        if grammar_kind is not None:
            self.constrained[grammar_kind] += 1

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, count: int, seconds: float) -> None:
        """`count` tokens arrived together, `seconds` after the previous ones: each counts as seconds / count."""
        self.generation_tokens += count
        if seconds > 0 and count > 0:
            self.itl.observe(seconds / count, count)

    def prefilled(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens

    def finished(self, reason: str, seconds: float) -> None:
        self.success[reason] += 1
        self.e2e.observe(seconds)

    def failed(self, reason: str) -> None:
        self.failure[reason] += 1

    def refused(self, message: str) -> None:
        self.refusals[refusal_reason(message)] += 1

    def families(self) -> Iterable[Metric]:
        model = self.model

        def counter(name: str, doc: str, value: float, **labels: str) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
            family.add_metric([model, *labels.values()], float(value))
            return family

        def by_label(name: str, doc: str, label: str, counts: Counter[str]) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
            for key, value in sorted(counts.items()):
                family.add_metric([model, key], float(value))
            return family

        yield counter("prompt_tokens", "Prompt tokens computed (at each request's first token)", self.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated", self.generation_tokens)
        yield by_label("request_success", "Requests finished, by finish reason", "finished_reason", self.success)
        yield by_label("request_failure", "Requests that ended in an error, by reason", "reason", self.failure)
        yield by_label("constrained_requests", "Requests with an output constraint, by kind", "kind", self.constrained)
        yield by_label("grammar_refusals", "Output constraints refused, by reason", "reason", self.refusals)
        yield self.ttft.family("time_to_first_token_seconds", "Time to the first token", model)
        yield self.itl.family("inter_token_latency_seconds", "Time between two output tokens", model)
        yield self.e2e.family("e2e_request_latency_seconds", "Arrival to last token", model)


class RequestWatch:
    """One request's timeline, as the TokenizerManager sees its outputs arrive."""

    def __init__(self, metrics: RequestMetrics, grammar_kind: str | None):
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        metrics.started(grammar_kind)

    def tokens(self, count: int, prompt_tokens: int) -> None:
        """`count` output tokens arrived. The prompt counts at the first: a request that fails or is aborted
        later has had its prompt computed all the same (it counted only when the request finished)."""
        if count <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.first_token(now - self.start)
            self.metrics.prefilled(prompt_tokens)
            self.metrics.tokens(count, 0.0)
        else:
            self.metrics.tokens(count, now - self.last)
        self.last = now

    def finished(self, reason: str) -> None:
        self.metrics.finished(reason, time.monotonic() - self.start)

    def failed(self, reason: str, refusal: str | None = None) -> None:
        self.metrics.failed(reason)
        if refusal is not None:
            self.metrics.refused(refusal)


def _histogram_family(name: str, doc: str, report: dict, model: str) -> HistogramMetricFamily | None:
    """A /get_server_info histogram report (milliseconds, non-cumulative "<= bound" buckets) in seconds."""
    if not isinstance(report, dict) or not report.get("count"):
        return None
    cumulative, running = [], 0
    finite = sorted((float(k[3:]), v) for k, v in (report.get("buckets_ms") or {}).items() if k.startswith("<= "))
    for bound_ms, count in finite:
        running += count
        cumulative.append((f"{bound_ms / 1000:g}", running))
    cumulative.append(("+Inf", report["count"]))
    family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
    family.add_metric([model], cumulative, sum_value=report.get("sum_ms", 0.0) / 1000)
    return family


def scheduler_families(info: dict, output_checks: dict, model: str) -> Iterable[Metric]:
    """Metric families from the scheduler's report (Scheduler.server_info) and the output checker's counts."""

    def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model], float(value or 0))
        return family

    def counter(name: str, doc: str, value) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model], float(value or 0))
        return family

    def labelled(name: str, doc: str, label: str, values: dict, keys: tuple[str, ...]) -> CounterMetricFamily:
        """One family, a sample per key (one HELP and TYPE line: strict parsers refuse a family given twice)."""
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
        for key in keys:
            family.add_metric([model, key], float(values.get(key) or 0))
        return family

    pool, cache, stats = info.get("kv_pool", {}), info.get("prefix_cache", {}), info.get("stats", {})
    yield gauge("num_requests_running", "Requests in the running batch", info.get("num_running"))
    yield gauge("num_requests_waiting", "Requests waiting for admission", info.get("num_waiting"))
    compiling = info.get("num_grammar_compiling")
    yield gauge("num_requests_grammar_compiling", "Requests waiting for their grammar", compiling)
    total = pool.get("total_slots") or 0
    usage = pool.get("used_slots", 0) / total if total else 0
    yield gauge("kv_cache_usage_perc", "Share of KV slots held by running requests", usage)
    yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", cache.get("query_tokens"))
    yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", cache.get("hit_tokens"))
    yield counter("num_preemptions", "Requests sent back to the queue for lack of KV", stats.get("retractions"))
    compiles = info.get("grammar_compiles") or {}
    doc = "Grammar requests by how they were answered"
    yield labelled("grammar_compiles", doc, "source", compiles, ("compiled", "shared", "cache", "disk", "failed"))
    timing = info.get("grammar_timing") or {}
    yield counter("grammar_loop_bans", "Masks narrowed by the loop guard", timing.get("loop_bans"))
    for name, key, doc in (
        ("grammar_compile_seconds", "grammar_compile_ms", "Grammar compile time"),
        ("grammar_fill_seconds", "grammar_fill_ms_per_reply", "Grammar mask fill time per step"),
    ):
        family = _histogram_family(name, doc, info.get(key), model)
        if family is not None:
            yield family
    doc = "Last checks of constrained outputs, by result"
    results = ("checked", "invalid", "unchecked", "retried", "recovered")
    yield labelled("output_checks", doc, "result", output_checks, results)


class _Snapshot:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(request_metrics: RequestMetrics, info: dict, output_checks: dict) -> bytes:
    families = [*request_metrics.families(), *scheduler_families(info, output_checks, request_metrics.model)]
    registry = CollectorRegistry()
    registry.register(_Snapshot(families))
    return generate_latest(registry)
