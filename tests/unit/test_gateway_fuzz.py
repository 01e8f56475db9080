"""Property-based fuzzing of the OpenAI routes (``lmfleet.testing.gateway_fuzz``): never a 5xx, every error
OpenAI-shaped, no local slot left in flight, every request counted. The longer run is benchmarks/fuzz_gateway.py.
"""

from __future__ import annotations

import math

import pytest

from lmfleet.testing.gateway_fuzz import run_fuzz


@pytest.mark.timeout(300)
def test_fuzzed_bodies_never_5xx_never_leak_and_are_counted(tmp_path):
    report: dict = {}
    run_fuzz(tmp_path, 1500, report=report)
    assert report["requests"] >= 1000
    assert report["statuses"].get(200, 0) > 50 and sum(n for s, n in report["statuses"].items() if s >= 400) > 500
    assert not math.isnan(report["seconds"])
