"""examples/prometheus/lmfleet-alerts.yml is a Prometheus rule file whose expressions read only series the gateway
exports, by labels those series carry."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import Counter, Histogram

from lmfleet.gateway.observe.metrics import GatewayMetrics

RULES = Path(__file__).resolve().parents[2] / "examples" / "prometheus" / "lmfleet-alerts.yml"
_SERIES = re.compile(r"\b(lmfleet_[A-Za-z0-9_]+)\b")
_GROUPING = re.compile(r"\b(?:by|on)\s*\(([^)]*)\)")
_DURATION = re.compile(r"^\d+[smhd]$")


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    return [r for g in doc["groups"] for r in g["rules"]]


def gateway_labels() -> dict[str, set[str]]:
    """Every series name the gateway exports, with its labels, from a real GatewayMetrics' registry."""
    out: dict[str, set[str]] = {}
    for c in GatewayMetrics().registry._collector_to_names:  # noqa: SLF001 - the registry's own collector list
        name, labels = getattr(c, "_name", None), set(getattr(c, "_labelnames", ()))
        if name is None:  # a custom collector (the replica gauges)
            for f in c.describe():
                out[f.name] = {"model", "replica"}
            continue
        suffixes = ("_total",) if isinstance(c, Counter) else ("_bucket", "_sum", "_count") \
            if isinstance(c, Histogram) else ("",)
        out.update({name + s: labels for s in suffixes})
    return out


def test_rules_parse_as_prometheus_alerting_rules():
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        assert g["name"] and g["rules"]
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) >= 2
    for r in rules():
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert _DURATION.match(r["for"]) and r["labels"]["severity"]
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert r["expr"].count("(") == r["expr"].count(")")


def test_rules_read_only_series_and_labels_the_gateway_exports():
    exported = gateway_labels()
    for r in rules():
        used = set(_SERIES.findall(r["expr"]))
        assert used, r["alert"]
        assert used <= set(exported), f"{r['alert']}: {sorted(used - set(exported))} are not gateway series"
        grouped = {x.strip() for g in _GROUPING.findall(r["expr"]) for x in g.split(",") if x.strip()}
        for s in used:
            assert grouped <= exported[s], f"{r['alert']}: {s} has no label {sorted(grouped - exported[s])}"


def test_rules_cover_the_calibration_gauges():
    used = {s for r in rules() for s in _SERIES.findall(r["expr"])}
    assert {"lmfleet_estimate_p90_abs_error_threshold_ratio", "lmfleet_estimate_local_miss_ratio",
            "lmfleet_estimate_window_requests"} <= used
