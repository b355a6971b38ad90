"""A fixed-bucket latency histogram (milliseconds) with quantile estimates, for /get_server_info reports."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds (ms) of the buckets; one more bucket holds everything above the last.
DEFAULT_BOUNDS_MS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


@dataclass
class Histogram:
    bounds: tuple[float, ...] = DEFAULT_BOUNDS_MS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    max: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value_ms: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value_ms)] += 1
        self.total += value_ms
        self.max = max(self.max, value_ms)

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile `q` (the maximum for the last bucket); None if empty."""
        n = self.count
        if n == 0:
            return None
        rank, seen = q * n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return min(self.bounds[i], self.max) if i < len(self.bounds) else self.max
        return self.max

    def report(self) -> dict:
        """Count, sum, mean, p50 / p90 / p99 (bucket upper bounds), max, and the non-empty buckets as
        {"<= bound": count} (the last as "> bound")."""
        n = self.count
        buckets = {}
        for i, c in enumerate(self.counts):
            if c:
                key = f"<= {self.bounds[i]:g}" if i < len(self.bounds) else f"> {self.bounds[-1]:g}"
                buckets[key] = c
        return {
            "count": n,
            "sum_ms": round(self.total, 3),
            "mean_ms": round(self.total / n, 3) if n else None,
            "p50_ms": self.quantile(0.5),
            "p90_ms": self.quantile(0.9),
            "p99_ms": self.quantile(0.99),
            "max_ms": round(self.max, 3),
            "buckets_ms": buckets,
        }
