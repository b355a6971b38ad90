"""A short soak in CI (benchmarks/soak.py against the shared server): mixed requests, aborts, disconnects and
hostile bodies; every request ends as its kind expects, and the KV pool and grammar slots are whole after."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import soak  # noqa: E402


def test_short_soak_loses_nothing(base_url, tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--url", base_url, "--requests", "80", "--concurrency", "16", "--seed", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report
    assert not report["lost_or_wrong"] and report["health_after"] == 200
    assert sum(sum(c.values()) for c in report["outcomes"].values()) == 80
    assert report["grammar_slots_in_use"] == 0 and report["grammar_live_requests"] == 0
