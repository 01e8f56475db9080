"""examples/grafana/lmfleet.json queries only series that exist: the gateway's own (from its real metrics
registry) and vLLM's, as the installed vLLM defines them and Ray's metrics agent names them (issue 16)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge, Histogram

from lmfleet.gateway.observe.metrics import GatewayMetrics, ReplicaGauges

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "lmfleet.json"
_SERIES = re.compile(r"\b((?:lmfleet|ray_vllm)_[A-Za-z0-9_]+)\b")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queried_series() -> set[str]:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dashboard()["templating"]["list"]]
    return {name for e in exprs for name in _SERIES.findall(e)}


def gateway_series() -> set[str]:
    """Every series name the gateway's /metrics can carry, from the collectors of a real GatewayMetrics."""
    out = set()
    for c in GatewayMetrics().registry._collector_to_names:  # noqa: SLF001 - the registry's own collector list
        if isinstance(c, ReplicaGauges):
            out |= {f.name for f in c.describe()}
            continue
        kind = "counter" if isinstance(c, Counter) else "histogram" if isinstance(c, Histogram) else \
            "gauge" if isinstance(c, Gauge) else None
        assert kind, f"unexpected collector {c!r}"
        out |= {c._name + s for s in _SUFFIXES[kind]}  # noqa: SLF001
    return out


def vllm_series() -> set[str]:
    """vLLM's metrics as Ray exports them: ``vllm:NAME`` becomes ``ray_vllm_NAME`` (RayPrometheusMetric sanitizes
    ':'), read from the installed vLLM's metric definitions."""
    spec = importlib.util.find_spec("vllm.v1.metrics.loggers")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    src = Path(spec.origin).read_text()
    out = set()
    for kind, name in re.findall(r"self\._(gauge|counter|histogram)_cls\(\s*name=\"vllm:([a-z_]+)\"", src):
        base = "ray_vllm_" + name
        # Prometheus counters read NAME_total whether or not the definition carries the suffix
        out |= {base.removesuffix("_total") + s for s in _SUFFIXES[kind]}
    assert "ray_vllm_num_requests_running" in out, "vLLM's metric definitions moved; update this parser"
    return out


def test_every_queried_series_is_exported():
    queried = queried_series()
    known = gateway_series() | vllm_series()
    assert queried, "no metric names found in the dashboard"
    assert queried <= known, f"the dashboard queries series nobody exports: {sorted(queried - known)}"


def test_engine_queue_series_are_the_ones_lmfleet_parses():
    from lmfleet.overflow.engine_stats import _RUNNING, _WAITING

    assert {n for n in _RUNNING | _WAITING if n.startswith("ray_")} <= queried_series()


@pytest.mark.parametrize("metric", ["lmfleet_requests_total", "lmfleet_time_to_first_token_seconds_bucket",
                                    "lmfleet_cost_usd_total", "lmfleet_queue_estimate_ms", "lmfleet_routed_total",
                                    "ray_vllm_num_requests_waiting", "ray_vllm_request_prefill_time_seconds_bucket"])
def test_the_main_questions_have_a_panel(metric):
    assert metric in queried_series()


def test_panels_are_well_formed():
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "model"}
