"""A self-contained HTML report: the tables plus matplotlib plots embedded as base64 PNGs."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from lmfleet.bench.report import TABLE_ROWS  # noqa: E402

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%}
pre{background:#f7f7f7;padding:1em;overflow:auto}"""


def png_b64(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plot_cdfs(report: dict[str, Any]) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "e2el_s", "End-to-end latency"), (axes[1], "ttft_s", "Time to first token")):
        for provider, samples in report["samples"].items():
            xs = np.sort(np.asarray(samples[key]) * 1000)
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=provider)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    return png_b64(fig)


def plot_timeseries(report: dict[str, Any]) -> str:
    ts = report["timeseries"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    axes[0].plot(ts["t"], ts["output_tps"], drawstyle="steps-post")
    axes[0].set(ylabel="output tok/s", title="Throughput over time")
    axes[1].plot(ts["t"], ts["in_flight"], color="tab:orange", drawstyle="steps-post")
    axes[1].set(ylabel="requests in flight")
    axes[2].plot(ts["t"], [100 * x for x in ts["external_share"]], color="tab:red", drawstyle="steps-post")
    axes[2].set(ylabel="% served externally", xlabel="seconds since start", ylim=(-5, 105))
    for ax in axes:
        ax.grid(alpha=0.3)
    return png_b64(fig)


def table_html(report: dict[str, Any], section: str) -> str:
    groups = list(report[section].items())
    head = "".join(f"<th>{html.escape(n)}</th>" for n, _ in groups)
    rows = []
    for label, get in TABLE_ROWS:
        cells = "".join(f"<td>{html.escape(get(s))}</td>" for _, s in groups)
        overall = html.escape(get(report["overall"]))
        rows.append(f"<tr><td>{html.escape(label)}</td>{cells}<td><b>{overall}</b></td></tr>")
    return f"<table><tr><th>Metric</th>{head}<th>Overall</th></tr>{''.join(rows)}</table>"


def render_html(report: dict[str, Any]) -> str:
    meta = html.escape("\n".join(f"{k}: {v}" for k, v in report["meta"].items()))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>lmfleet bench report</title>
<style>{CSS}</style></head><body>
<h1>lmfleet bench report</h1>
<pre>{meta}</pre>
<h2>Per provider</h2>{table_html(report, "providers")}
<h2>Per workload class</h2>{table_html(report, "classes")}
<h2>Latency distributions</h2><img alt="latency CDFs" src="data:image/png;base64,{plot_cdfs(report)}">
<h2>Over time</h2><img alt="throughput, in-flight and external share over time"
 src="data:image/png;base64,{plot_timeseries(report)}">
<p>Metric definitions follow <code>vllm bench serve</code>; see docs/bench.md.</p>
</body></html>"""


def write_html(report: dict[str, Any], path: Path) -> None:
    path.write_text(render_html(report))
