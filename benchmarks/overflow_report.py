"""The per-trace table and the attainment-vs-spend plot of several ``bench_overflow_policies.py`` runs.

    .venv/bin/python benchmarks/overflow_report.py out/op_*/summary.json --out out/overflow_report
    .venv/bin/python benchmarks/overflow_report.py --smoke --out out/overflow_report   # the runs in docs/benchmarks

Each summary is one trace (its window and factors are in the table); arms are lmfleet's policies and, where the
run had ``--litellm``, the real LiteLLM proxy. Writes ``report.md`` (the table, then per trace which of issue 48's
targets held: :func:`lmfleet.bench.policy_report.targets`) and ``attainment_vs_spend.png`` (one panel per trace:
SLO attainment against provider dollars, one point per arm, the oracle's dollars dotted).

``--refit-oracle``: where a run's ``outcomes.jsonl`` lies beside its summary (or ``NAME.outcomes.jsonl.gz`` beside
``NAME.json``, as under docs/benchmarks), its oracle is fitted again with the
benchmark's current local model (:func:`lmfleet.bench.overflow_figures.refit_oracle`), so runs recorded with an
older fit compare on the same footing; the report lists each run's oracle before and after, and where the run has an
``oracle plan`` arm, per round how many of its locally answered requests missed the SLO against how many the refitted
model predicts to miss (:func:`lmfleet.bench.overflow_figures.plan_misses`), and the lower bound on the oracle's spend
(:mod:`lmfleet.overflow.bound`: the cheapest spill set on an engine relaxed to prefill alone, at the fastest rate
the run measured), with each arm's spend over it in the table's ``× bound $`` column.
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import replace
from pathlib import Path

from lmfleet.bench.overflow_figures import refit_oracle
from lmfleet.bench.policy_report import Row, attribution, markdown, rows, targets, trace_label

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def plot(by_trace: dict[str, list[Row]], oracle: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(by_trace))
    nrows = -(-len(by_trace) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(by_trace):]:
        ax.set_visible(False)
    for ax, (trace, rs) in zip(axes.flat, by_trace.items()):
        for r in rs:
            marker = "s" if r.arm.startswith("litellm") else "o"
            ax.scatter(r.spend_usd, 100 * r.attainment, marker=marker, s=50)
            ax.annotate(r.arm, (r.spend_usd, 100 * r.attainment), fontsize=8, xytext=(4, 3), textcoords="offset points")
        ax.set_title(trace if len(trace) < 60 else trace[:57] + "...", fontsize=9)
        ax.set_xlabel("provider $ (from its usage)")
        ax.set_ylabel("TTFT SLO attained (%)")
        ax.set_ylim(-2, 104)
        ax.axhline(99, color="grey", lw=0.6, ls="--")
        if oracle.get(trace):
            ax.axvline(oracle[trace], color="grey", lw=0.6, ls=":")
            ax.annotate("oracle $", (oracle[trace], 50), fontsize=8, rotation=90, xytext=(2, 0),
                        textcoords="offset points")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("summaries", nargs="*", type=Path, help="summary.json files of bench_overflow_policies.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="the summaries recorded under docs/benchmarks/")
    ap.add_argument("--refit-oracle", action="store_true",
                    help="fit each run's oracle again from the outcomes.jsonl beside its summary (when there is one)")
    a = ap.parse_args()
    files = sorted(DOCS.glob("bench_overflow_policies_*.json")) if a.smoke else a.summaries
    if not files:
        ap.error("no summary.json given")
    by_trace: dict[str, list[Row]] = {}
    credits: set[str] = set()
    oracle: dict[str, float] = {}
    refits: list[str] = []
    for f in files:
        s = json.loads(f.read_text())
        t = s.get("trace") or {}
        if "results" not in s or not ("name" in t or t.get("kind") == "trace"):  # runs from before traces were named
            continue
        label = trace_label(s)
        runs = sum(1 for t in by_trace if t == label or t.startswith(f"{label} (run "))
        if runs:  # another run of the same trace: its own rows, targets and panel
            label = f"{label} (run {runs + 1})"
        outcomes = next((p for p in (f.parent / "outcomes.jsonl", f.with_suffix(".outcomes.jsonl.gz")) if p.exists()),
                        None)
        if a.refit_oracle and outcomes is not None:
            before = (s.get("oracle") or {}).get("spend_usd")
            text = (gzip.decompress(outcomes.read_bytes()).decode() if outcomes.suffix == ".gz"
                    else outcomes.read_text())
            try:
                s["oracle"] = refit_oracle(s, [json.loads(line) for line in text.splitlines()])
            except ValueError as e:
                refits.append(f"- {label}: oracle not refitted ({e})")
            else:
                o = s["oracle"]
                refits.append(f"- {label}: oracle ${before or 0:.5f} -> ${o['spend_usd']:.5f} (spills "
                              f"{o['spilled']} of {o['of']} per round; local model {o['model']})")
                if o.get("bound"):
                    refits.append(f"  lower bound on the oracle's spend ${o['bound']['spend_usd']:.5f} (the engine "
                                  f"at its demonstrated {o['bound']['rate_tps']:.0f} prompt tokens/s)")
                if o.get("plan_check"):
                    refits.append("  oracle plan, requests answered locally that missed the SLO / the refitted model "
                                  "predicts to miss: " + "; ".join(f"round {c['round']}: {c['missed']} / "
                                                                   f"{c['predicted']} of {c['local']}"
                                                                   for c in o["plan_check"]))
        if (credit := attribution(s)) is not None:
            credits.add(credit)
        for r in rows(s):
            by_trace.setdefault(label, []).append(replace(r, trace=label))
        oracle[label] = float((s.get("oracle") or {}).get("spend_usd") or 0.0)
    a.out.mkdir(parents=True, exist_ok=True)
    text = ["# Overflow policies per trace", "", markdown([r for rs in by_trace.values() for r in rs])]
    text += [f"Trace: {c}" for c in sorted(credits)] + [""]
    if refits:
        text += ["Oracles fitted again from outcomes.jsonl:", *refits, ""]
    for trace, rs in by_trace.items():
        held = targets(rs)
        text.append(f"- {trace}: " + "; ".join(f"{k}: {'–' if v is None else ('met' if v else 'MISSED')}"
                                               for k, v in held.items()))
    (a.out / "report.md").write_text("\n".join(text) + "\n")
    plot(by_trace, oracle, a.out / "attainment_vs_spend.png")
    print("\n".join(text))
    print(f"\nwritten to {a.out}")


if __name__ == "__main__":
    main()
