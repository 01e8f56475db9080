"""The wait estimators compared leave-one-trace-out: fitted on the other traces, judged on the one held out.

    .venv/bin/python benchmarks/estimator_loto.py out/ds/*.jsonl --out out/estimator_loto
    .venv/bin/python benchmarks/estimator_loto.py --smoke --out out/estimator_loto   # a synthetic dataset
    .venv/bin/python benchmarks/estimator_loto.py out/ds/*.jsonl --prefill-line gateway   # the gateway's prefill line
    .venv/bin/python benchmarks/estimator_loto.py --miss-floors 0 0.05 0.1 0.15 0.2 0.25 \
        out/ds/a.jsonl@"predictive gated" out/ds/b.jsonl.gz   # overflow.miss_floor on the recorded decisions

The datasets come from replays (one file per trace or shape; a file may hold several, each row names its own)::

    .venv/bin/python benchmarks/bench_overflow_policies.py --shape gamma --out out/p-gamma \\
        --dataset-out out/ds/gamma.jsonl

Each row is one request the local engines answered: what the gateway knew when it predicted its wait (the ledger's
``admission`` record, :mod:`lmfleet.overflow.admission`) and the wait it had. The candidates are
:data:`lmfleet.overflow.estimators.CANDIDATES` (the shipped estimate, with its live margin, and fitted
alternatives); the figures are :mod:`lmfleet.bench.loto`'s: per candidate and held-out trace, the P90 absolute
error (ms and % of the threshold), the share of the requests it would have kept local that missed the threshold,
and the share of those it would have spilled that did not need it, beside the same candidate tuned on all traces.

Writes to ``--out``: ``loto.md`` (the table and each candidate's worst held-out trace), ``loto.json`` (every score)
and ``predicted_vs_realised.png`` (the held-out predictions against the realised waits, per candidate).
``--smoke``: three synthetic traces (:func:`lmfleet.bench.loto.synthetic_dataset`), seconds; not a measurement.

``--miss-floors F ...`` compares values of ``overflow.miss_floor`` instead (:mod:`lmfleet.bench.miss_floor`): per
trace, the misses among the requests kept local, and what each floor would have spilled of them (misses caught,
spills added) and the part of it on an idle engine, then the floor chosen leave-one-trace-out (``--miss-weight``
added spills worth one kept miss).
``PATH@POLICY`` takes only that policy's rows from a file (a replay's arms share one trace name); writes
``miss_floor.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lmfleet.bench.loto import (LINES, loto, read_datasets, scores_json, synthetic_dataset, table,
                                with_prefill_line, worst)
from lmfleet.bench.miss_floor import floor_counts, floor_loto
from lmfleet.overflow.estimators import CANDIDATES, admission_of


def plot(datasets: dict[str, list[dict]], names: list[str], path: Path) -> None:
    """Held-out predicted vs realised wait, one panel per candidate, one colour per trace; log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        c = CANDIDATES[name]
        lo, hi = 10.0, 10.0
        for trace, test in datasets.items():
            params = c.fit([r for t, rs in datasets.items() if t != trace for r in rs])
            pred = [max(1.0, c.predict(params, r)) for r in test]
            real = [max(1.0, float(r["realised_wait_ms"])) for r in test]
            ax.scatter(pred, real, s=6, alpha=0.5, label=trace)
            hi = max(hi, *pred, *real)
        thr = float(admission_of(next(iter(datasets.values()))[0]).threshold_ms)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.axvline(thr, color="red", lw=0.6, ls="--")
        ax.axhline(thr, color="red", lw=0.6, ls="--")
        ax.set(xscale="log", yscale="log", title=name, xlabel="predicted ms (held out)", ylabel="realised ms")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("datasets", nargs="*", type=Path, help="JSON-lines files from bench_overflow_policies.py "
                    "--dataset-out (rows grouped by their trace)")
    ap.add_argument("--out", type=Path, default=Path("out") / "estimator_loto")
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--smoke", action="store_true", help="a synthetic dataset of three traces (not a measurement)")
    ap.add_argument("--prefill-line", choices=list(LINES), default="recorded",
                    help="replay every estimate with this prefill rule (lmfleet.bench.loto.with_prefill_line): "
                    "'gateway' the gateway's prefill line; 'theil-sen' / 'weighted' a slope on the recorded base "
                    "TTFT; 'recorded' as the rows have it. Compare replays with each other: a replay has only the "
                    "dataset's requests")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--miss-floors", nargs="+", type=float, metavar="F",
                    help="compare these overflow.miss_floor values on the recorded decisions instead")
    ap.add_argument("--miss-weight", type=float, default=3.0,
                    help="with --miss-floors: how many added spills one kept miss is worth when choosing")
    args = ap.parse_args()
    if args.smoke:
        datasets, source = synthetic_dataset(), "synthetic (--smoke)"
    elif not args.datasets:
        ap.error("give dataset files (bench_overflow_policies.py --dataset-out), or --smoke")
    else:
        split = [(Path(p), pol if at else None) for p, at, pol in (str(d).partition("@") for d in args.datasets)]
        try:
            if args.miss_floors:  # one entry per file: a synthetic shape's seeds share its trace name
                datasets = {p.name.removesuffix(".gz").removesuffix(".jsonl").removeprefix("estimator_dataset_"):
                            [r for rs in read_datasets([p], {p: pol} if pol else None).values() for r in rs]
                            for p, pol in split}
            else:
                datasets = read_datasets([p for p, _ in split], {p: pol for p, pol in split if pol})
        except (OSError, ValueError) as e:
            ap.error(str(e))
        source = " ".join(map(str, args.datasets))
    if len(datasets) < 2:
        ap.error(f"leave-one-trace-out needs rows of two traces or more; found {sorted(datasets) or 'none'}")
    if args.miss_floors:
        return miss_floors(datasets, source, args.miss_floors, args.miss_weight, args.out)
    if (rule := LINES[args.prefill_line]) is not None:
        datasets = {t: with_prefill_line(rs, rule) for t, rs in datasets.items()}
        source += f" (prefill rule replayed: {args.prefill_line})"
    scores = loto(datasets, [CANDIDATES[n] for n in args.candidates])
    counts = ", ".join(f"{t} {len(rs)}" for t, rs in datasets.items())
    text = (f"# Wait estimators, leave-one-trace-out\n\ndatasets: {source}\nrequests per trace: {counts}\n\n"
            f"{table(scores)}\n\nworst held-out trace per candidate:\n\n"
            + "\n".join(f"- {w['candidate']}: P90 error {w['worst_p90_abs_error_pct']:.0f} % of the threshold "
                        f"({_num(w['worst_kept_p90_abs_error_pct'])} % on the requests it keeps local), "
                        f"kept-and-missed {_pct(w['worst_missed_share'])}, spilled-needlessly "
                        f"{_pct(w['worst_needless_share'])}" for w in worst(scores)) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loto.md").write_text(text)
    (args.out / "loto.json").write_text(json.dumps({"source": source, "scores": scores_json(scores)}, indent=1))
    if not args.no_plot:
        plot(datasets, args.candidates, args.out / "predicted_vs_realised.png")
    print(text)
    print(f"written to {args.out}")
    return 0


def miss_floors(datasets: dict[str, list[dict]], source: str, floors: list[float], weight: float, out: Path) -> int:
    """The ``--miss-floors`` report (module docstring)."""
    lines = [f"# overflow.miss_floor on the recorded decisions\n\ndatasets: {source}\n",
             "| trace | kept local | missed | " + " | ".join(f"floor {f:g}: caught / added" for f in floors) + " |",
             "|---|---|---|" + "---|" * len(floors)]
    total = {f: [0, 0] for f in floors}
    by_trace = {trace: [floor_counts(rows, f) for f in floors] for trace, rows in datasets.items()}
    for trace, counts in by_trace.items():
        for f, c in zip(floors, counts):
            total[f][0] += c.caught
            total[f][1] += c.added
        lines.append(f"| {trace} | {counts[0].local} | {counts[0].missed} | "
                     + " | ".join(f"{c.caught} / {c.added}" for c in counts) + " |")
    lines.append("| all | | | " + " | ".join(f"{total[f][0]} / {total[f][1]}" for f in floors) + " |")
    lines += ["", "of which on an idle engine with a measured prefill line (the floor there, not a learned margin):",
              "", "| trace | " + " | ".join(f"floor {f:g}: caught / added" for f in floors) + " |",
              "|---|" + "---|" * len(floors)]
    idle_total = {f: [0, 0] for f in floors}
    for trace, rows in datasets.items():
        parts = []
        for f, on in zip(floors, by_trace[trace]):
            off = floor_counts(rows, f, idle=False)
            idle_total[f][0] += on.caught - off.caught
            idle_total[f][1] += on.added - off.added
            parts.append(f"{on.caught - off.caught} / {on.added - off.added}")
        lines.append(f"| {trace} | " + " | ".join(parts) + " |")
    lines.append("| all | " + " | ".join(f"{idle_total[f][0]} / {idle_total[f][1]}" for f in floors) + " |")
    picks = floor_loto(datasets, floors, weight)
    lines += ["", f"leave-one-trace-out (one kept miss = {weight:g} added spills):", "",
              "| held out | floor chosen on the others | kept missed | caught | added |", "|---|---|---|---|---|"]
    lines += [f"| {p.held_out} | {p.floor:g} | {p.count.kept_missed} | {p.count.caught} | {p.count.added} |"
              for p in picks]
    lines.append(f"| all | | {sum(p.count.kept_missed for p in picks)} | {sum(p.count.caught for p in picks)} | "
                 f"{sum(p.count.added for p in picks)} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "miss_floor.md").write_text(text)
    print(text)
    print(f"written to {out}")
    return 0


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
