"""``lmfleet bench sweep``: the same workload at several request rates, user counts or overflow thresholds.

The overflow threshold is set through the gateway's admin endpoint before each step:
``POST {base_url}/admin/overflow`` with ``{"model": NAME, "threshold_ms": X}`` and
``Authorization: Bearer $LMFLEET_ADMIN_KEY``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import httpx

from lmfleet.bench.html import CSS, png_b64, plt
from lmfleet.bench.loadgen import LoadPlan
from lmfleet.bench.workload import BenchInputError
from lmfleet.provenance import is_external

SWEEP_PARAMS = ("rate", "users", "overflow")


def parse_values(text: str, param: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchInputError(f"--values {text!r}: expected comma-separated numbers, e.g. 1,2,4,8") from None
    if not values:
        raise BenchInputError("--values: give at least one value")
    if param not in SWEEP_PARAMS:
        raise BenchInputError(f"--over {param!r}: expected one of {SWEEP_PARAMS}")
    if param in ("rate", "users") and any(v <= 0 for v in values):
        raise BenchInputError(f"--values for {param} must be > 0, got {values}")
    if param == "users" and any(v != int(v) for v in values):
        raise BenchInputError(f"--values for users must be whole numbers, got {values}")
    if param == "overflow" and any(v <= 0 for v in values):
        raise BenchInputError(f"--values for overflow (threshold in ms) must be > 0, got {values}")
    return values


def plan_for(plan: LoadPlan, param: str, value: float) -> LoadPlan:
    if param == "rate":
        return dataclasses.replace(plan, rate=value, users=None)
    if param == "users":
        return dataclasses.replace(plan, users=int(value), rate=None)
    return plan


def set_overflow(base_url: str, model: str, threshold_ms: float, admin_key: str | None,
                 transport: httpx.BaseTransport | None = None) -> None:
    """Set the gateway's overflow threshold; any failure is a ``BenchInputError`` (nothing sent yet)."""
    if not admin_key:
        raise BenchInputError("sweeping the overflow threshold needs the admin key in $LMFLEET_ADMIN_KEY")
    url = f"{base_url.rstrip('/')}/admin/overflow"
    try:
        with httpx.Client(transport=transport, timeout=10) as client:
            r = client.post(url, json={"model": model, "threshold_ms": threshold_ms},
                            headers={"Authorization": f"Bearer {admin_key}"})
    except httpx.HTTPError as e:
        raise BenchInputError(f"cannot set the overflow threshold at {url}: {e}") from None
    if r.status_code >= 300:
        raise BenchInputError(f"POST {url} answered {r.status_code}: {r.text[:200]}")


def sweep_row(param: str, value: float, report: dict[str, Any]) -> dict[str, Any]:
    o = report["overall"]
    served_ext = sum(s["completed"] for p, s in report["providers"].items() if is_external(p))
    return {
        param: value,
        "requests": o["requests"], "error_rate": o["error_rate"],
        "request_throughput": o["request_throughput"], "output_throughput": o["output_throughput"],
        "e2el_p50_ms": o["e2el_ms"]["p50"], "e2el_p99_ms": o["e2el_ms"]["p99"],
        "ttft_p99_ms": o["ttft_ms"]["p99"], "tpot_p99_ms": o["tpot_ms"]["p99"],
        "usd_per_1m_output": o.get("usd_per_1m_output"),
        "external_share": served_ext / o["completed"] if o["completed"] else 0.0,
    }


def run_sweep(param: str, values: list[float], run_step: Callable[[float], dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``run_step(value)`` for each value (it returns a report) and collect one row per step."""
    return [sweep_row(param, v, run_step(v)) for v in values]


def plot_sweep(rows: list[dict[str, Any]], param: str) -> str:
    xs = [r[param] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(xs, [r["e2el_p99_ms"] for r in rows], "o-", label="E2E P99 (ms)")
    ax.plot(xs, [r["ttft_p99_ms"] for r in rows], "s--", label="TTFT P99 (ms)")
    ax.set(xlabel={"rate": "request rate (req/s)", "users": "virtual users",
                   "overflow": "overflow threshold (ms)"}[param], ylabel="ms", title=f"Sweep over {param}")
    ax.grid(alpha=0.3)
    costs = [r["usd_per_1m_output"] for r in rows]
    if any(c is not None for c in costs):
        ax2 = ax.twinx()
        ax2.plot(xs, [c if c is not None else float("nan") for c in costs], "^-", color="tab:green",
                 label="$ / 1M output tokens")
        ax2.set_ylabel("$ / 1M output tokens")
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    return png_b64(fig)


def write_sweep(rows: list[dict[str, Any]], param: str, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "sweep.json", "csv": out_dir / "sweep.csv", "html": out_dir / "sweep.html"}
    paths["json"].write_text(json.dumps({"param": param, "rows": rows}, indent=2))
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    head = "".join(f"<th>{k}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
    paths["html"].write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>lmfleet bench sweep</title><style>{CSS}</style>"
        f"</head><body><h1>Sweep over {param}</h1><table><tr>{head}</tr>{body}</table>"
        f"<img alt='sweep plot' src='data:image/png;base64,{plot_sweep(rows, param)}'></body></html>")
    return paths


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)
