"""The prefill gate's service line replayed on recorded runs: what the gated estimate would have predicted for each
request kept local, against the estimate the run recorded and the wait the request had.

    .venv/bin/python benchmarks/gate_line_replay.py \
        docs/benchmarks/bench_overflow_policies_2026-12-07_az2550.outcomes.jsonl.gz@predictive ...
    .venv/bin/python benchmarks/gate_line_replay.py --smoke      # a synthetic run, seconds; not a measurement
    .venv/bin/python benchmarks/gate_line_replay.py --cold docs/benchmarks/estimator_dataset_*gateline*.jsonl.gz

Each ``PATH@POLICY`` is a ``bench_overflow_policies.py`` run's ``outcomes.jsonl(.gz)`` and an arm that ran with
``overflow.prefill_gate`` on (the ``predictive`` arm since the gate is ``auto``; ``predictive gated`` before). Per
round, the gate is rebuilt from the outcomes: one replica, first come first served, so a local streamed request
passed the gate when it was sent or when the local request sent before it had its first token, whichever came
later. At each request's send time the replay takes the gate's queue as it stood (the prompts held, the one through
the gate and how long ago), the service line fitted as the gateway fits it (:func:`lmfleet.overflow.signals.
prefill_line` over the last 64 gated prompts' gate-to-first-token times, the arm's earlier rounds included; from
:data:`~lmfleet.overflow.signals.GATE_MIN_SAMPLES` samples on, the recorded estimate before; the prefill line's
slope, for a service line without one, refitted the same way from the TTFTs by prompt plus tokens ahead), and
prices the request
with :func:`lmfleet.overflow.estimator.gate_wait_s`. It leaves out the queue term (a request behind a full engine):
at these loads the kept-local requests found a free slot.

Per run: the requests kept local (n), the recorded and the replayed estimate's P90 absolute error (% of the
threshold), the late requests (TTFT over the threshold) and how many each estimate put at or above
``--near`` x the threshold (where the miss margin spills them), and the on-time requests the replayed estimate put
there that the recorded one did not (spills it would add). The replay sees what the recorded decisions let through:
requests the recorded estimate spilled are not in it.

``--cold``: estimator datasets (``bench_overflow_policies.py --dataset-out``, rows with the gate's queue recorded)
instead. Their gated rows (the ``predictive`` arm) admitted before the service line had its samples, while the
prefill line was not stale and prompts were at the engine or in the gate, were estimated on the prefill line; each
is priced again with the shipped :func:`lmfleet.overflow.estimator.estimate_wait_ms` on the signals it recorded
(``gated``: the prefill line's TTFT per held prompt). Per dataset: those rows, their recorded and replayed P90
error, the late ones, how many of them the replayed estimate plus the recorded miss margin puts over the threshold
(caught) and the on-time ones it does (spills added).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

from lmfleet.overflow.admission import parse_admission
from lmfleet.overflow.estimate_error import percentile
from lmfleet.overflow.estimator import estimate_wait_ms, gate_wait_s
from lmfleet.overflow.signals import GATE_MIN_SAMPLES, PREFILL_SAMPLES, QueueSignals, prefill_line


def read(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def replay(rows: Iterable[dict], policy: str) -> list[tuple[float, float, float]]:
    """``(ttft_s, recorded_s, replayed_s)`` for each local streamed request of ``policy`` (module docstring)."""
    rows = [r for r in rows if r["policy"] == policy]
    out: list[tuple[float, float, float]] = []
    carried: list[tuple[float, float]] = []  # (tokens, gate-to-first-token s) of the arm's earlier rounds
    carried_ttft: list[tuple[float, float]] = []  # (prefill work, TTFT): the prefill line's samples
    for rnd in sorted({r["round"] for r in rows}):
        local = sorted((r for r in rows if r["round"] == rnd and r["served_by"].startswith("local")
                        and r["status"] == 200 and r.get("ttft_s") is not None), key=lambda r: r["sent_s"])
        first = [r["sent_s"] + r["ttft_s"] for r in local]
        entered = [max(r["sent_s"], first[i - 1] if i else -math.inf) for i, r in enumerate(local)]
        work = [r["prompt_tokens"] + sum(local[i]["prompt_tokens"] for i in range(j) if first[i] > r["sent_s"])
                for j, r in enumerate(local)]
        for j, r in enumerate(local):
            t = r["sent_s"]
            done = [(float(local[i]["prompt_tokens"]), first[i] - entered[i]) for i in range(j) if first[i] <= t]
            samples = (carried + done)[-PREFILL_SAMPLES:]
            recorded = r["estimate_ms"] / 1000.0
            line = prefill_line(samples) if len(samples) >= GATE_MIN_SAMPLES else None
            pline = prefill_line((carried_ttft + [(float(work[i]), local[i]["ttft_s"]) for i in range(j)
                                                  if first[i] <= t])[-PREFILL_SAMPLES:])
            if line is None:
                out.append((r["ttft_s"], recorded, recorded))
                continue
            queue = tuple((int(local[i]["prompt_tokens"]), None if entered[i] > t else t - entered[i])
                          for i in range(j) if first[i] > t)
            s = QueueSignals(now=t, in_flight=len(queue), drain_rps=None, output_tps=None, ttft_s=None,
                             base_ttft_s=None, completions_in_window=0,
                             pending_prefill_tokens=sum(q[0] for q in queue), gate_queue=queue,
                             gate_base_s=line.base_ttft_s, gate_base_tokens=line.base_work,
                             gate_s_per_token=line.slope, prefill_s_per_token=pline.slope if pline else None)
            out.append((r["ttft_s"], recorded, gate_wait_s(s, int(r["prompt_tokens"]))))  # type: ignore[arg-type]
        carried = (carried + [(float(local[i]["prompt_tokens"]), first[i] - entered[i])
                              for i in range(len(local))])[-PREFILL_SAMPLES:]
        carried_ttft = (carried_ttft + [(float(work[i]), local[i]["ttft_s"])
                                        for i in range(len(local))])[-PREFILL_SAMPLES:]
    return out


def score(rows: list[tuple[float, float, float]], threshold_s: float, near: float) -> dict:
    late = [r for r in rows if r[0] > threshold_s]
    on_time = [r for r in rows if r[0] <= threshold_s]
    edge = near * threshold_s
    return {"n": len(rows),
            "recorded_p90_pct": 100 * percentile([abs(a - b) for a, b, _ in rows], 90) / threshold_s,
            "replayed_p90_pct": 100 * percentile([abs(a - c) for a, _, c in rows], 90) / threshold_s,
            "late": len(late),
            "late_near_recorded": sum(b >= edge for _, b, _ in late),
            "late_near_replayed": sum(c >= edge for _, _, c in late),
            "spills_added": sum(c >= edge > b for _, b, c in on_time)}


def cold_rows(rows: Iterable[dict]) -> list[tuple[float, float, float, float, float]]:
    """``(realised_s, recorded_s, replayed_s, applied_margin_s, threshold_s)`` for each gated row admitted before
    the service line had samples (module docstring, ``--cold``)."""
    out = []
    for r in sorted(rows, key=lambda r: r["ts"]):
        if r["policy"] != "predictive" or r.get("realised_wait_ms") is None:
            continue
        a = parse_admission(r["admission"])
        s = a.signals
        if s.gate_base_s is not None or s.prefill_stale or not (s.gate_queue or s.pending_prefill_tokens):
            continue
        replayed = estimate_wait_ms(s, a.capacity, prompt_tokens=a.prompt_tokens, gated=True)
        out.append((r["realised_wait_ms"] / 1e3, a.estimate_ms / 1e3, replayed / 1e3, (a.applied_margin_ms or 0) / 1e3,
                    a.threshold_ms / 1e3))
    return out


def score_cold(rows: list[tuple[float, float, float, float, float]]) -> dict:
    late = [r for r in rows if r[0] > r[4]]

    def err(i: int) -> float:  # P90 |realised - estimate i|, % of the threshold
        return 100 * percentile([abs(r[0] - r[i]) for r in rows], 90) / rows[0][4] if rows else 0.0

    return {"n": len(rows), "recorded_p90_pct": err(1), "replayed_p90_pct": err(2), "late": len(late),
            "caught": sum(r[2] + r[3] > r[4] for r in late),
            "spills_added": sum(r[2] + r[3] > r[4] >= r[1] + r[3] for r in rows if r[0] <= r[4])}


def synthetic_cold() -> list[dict]:
    """A burst of short prompts meeting the gate with no service line: 0.4 s a prompt, priced at 1 ms a token."""
    sig = {"now": 0.0, "in_flight": 0, "drain_rps": 1.0, "output_tps": None, "ttft_s": None, "base_ttft_s": 0.4,
           "completions_in_window": 0, "prefill_s_per_token": 0.001, "base_prefill_tokens": 100.0}
    rows = []
    for i in range(10):
        queue = [[100, None]] * i
        s = {**sig, "in_flight": i, "pending_prefill_tokens": 100 * i, "gate_queue": queue}
        est = 400.0 + 100.0 * i
        rows.append({"ts": float(i), "policy": "predictive", "realised_wait_ms": 400.0 * (i + 1),
                     "predicted_wait_ms": est, "admission": {"signals": s, "capacity": 16, "prompt_tokens": 100,
                                                             "estimate_ms": est, "threshold_ms": 2500.0, "order": i,
                                                             "margin_ms": 0.0, "applied_margin_ms": 0.0}})
    return rows


def synthetic(seed: int = 1) -> list[dict]:
    """One gated arm, 2 rounds of 60 requests: a serial engine whose service is 0.3 s + 2 ms a token."""
    rng, rows = random.Random(seed), []
    for rnd in (1, 2):
        t, free = 0.0, 0.0
        for i in range(60):
            t += rng.expovariate(0.8)
            tokens = rng.choice([40, 80, 200, 600, 900])
            free = max(free, t) + 0.3 + 0.002 * tokens
            rows.append({"policy": "predictive", "round": rnd, "index": i, "prompt_tokens": tokens, "sent_s": t,
                         "ttft_s": free - t, "status": 200, "served_by": "local/m", "estimate_ms": 1000.0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="PATH@POLICY: a run's outcomes.jsonl(.gz) and a gated arm")
    ap.add_argument("--threshold-ms", type=float, default=2500.0)
    ap.add_argument("--near", type=float, default=0.85, help="share of the threshold counted as spilled")
    ap.add_argument("--smoke", action="store_true", help="a synthetic run instead (seconds; not a measurement)")
    ap.add_argument("--json", type=Path, help="also write the scores here")
    ap.add_argument("--cold", action="store_true", help="the arguments are estimator datasets (module docstring)")
    args = ap.parse_args()
    if args.cold:
        return cold_main(args)
    runs = [("synthetic", synthetic(), "predictive")] if args.smoke else []
    for spec in args.runs:
        path, _, policy = spec.partition("@")
        policy = policy.replace("_", " ")
        runs.append((Path(path).name.removesuffix(".gz").removesuffix(".jsonl"), read(path), policy or "predictive"))
    if not runs:
        ap.error("give PATH@POLICY runs, or --smoke")
    thr = args.threshold_ms / 1000.0
    print(f"| run | arm | kept local | P90 error recorded | replayed | late | near the threshold: recorded / "
          f"replayed | spills added |\n|---|---|---|---|---|---|---|---|")
    scores, totals = {}, [0, 0, 0, 0]
    for name, rows, policy in runs:
        s = score(replay(rows, policy), thr, args.near)
        scores[f"{name}@{policy}"] = s
        totals = [a + b for a, b in zip(totals, (s["late"], s["late_near_recorded"], s["late_near_replayed"],
                                                 s["spills_added"]))]
        print(f"| {name} | {policy} | {s['n']} | {s['recorded_p90_pct']:.0f} % | {s['replayed_p90_pct']:.0f} % | "
              f"{s['late']} | {s['late_near_recorded']} / {s['late_near_replayed']} | {s['spills_added']:+d} |")
    print(f"\nall runs: {totals[0]} late, {totals[1]} near the threshold on the recorded estimate, {totals[2]} on "
          f"the replayed; {totals[3]} spills added")
    if args.json:
        args.json.write_text(json.dumps(scores, indent=1))


def cold_main(args: argparse.Namespace) -> None:
    sets = [("synthetic", synthetic_cold())] if args.smoke else []
    sets += [(Path(p).name.removesuffix(".gz").removesuffix(".jsonl"), read(p)) for p in args.runs]
    if not sets:
        raise SystemExit("give estimator datasets, or --smoke")
    print("| dataset | gated rows before the service line | P90 error recorded | replayed | late | caught | "
          "spills added |\n|---|---|---|---|---|---|---|")
    scores, totals = {}, [0, 0, 0, 0]
    for name, rows in sets:
        s = scores[name] = score_cold(cold_rows(rows))
        totals = [a + b for a, b in zip(totals, (s["n"], s["late"], s["caught"], s["spills_added"]))]
        print(f"| {name} | {s['n']} | {s['recorded_p90_pct']:.0f} % | {s['replayed_p90_pct']:.0f} % | {s['late']} | "
              f"{s['caught']} | {s['spills_added']:+d} |")
    print(f"\nall: {totals[0]} rows, {totals[1]} late, {totals[2]} caught, {totals[3]} spills added")
    if args.json:
        args.json.write_text(json.dumps(scores, indent=1))


if __name__ == "__main__":
    main()
