"""Line up a ``bench_gateway.py --replica-probe`` run's client samples with what the probe saw inside the servers.

    .venv/bin/python benchmarks/probe_align.py out/bgpr     # the folder of the run's --out JSON

Per 32-stream phase: the client's TTFT (mean, maximum) against the time its requests spent inside vLLM's app
(arrival -> first body byte, from ``replica_probe.jsonl`` / ``bare_probe.jsonl``), Serve's wrapper time (its
``_direct_ingress_asgi`` entry -> vLLM's app) where the probe stamped it, and for the phase's slowest requests
when the slowest request near them entered the server and vLLM's app, in seconds after the client sent it.
Matching is by time, not by request id: "near" is the requests that entered vLLM's app up to 3 s after.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        e = json.loads(line)
        if e["ev"] == "http" and e.get("first_byte") and "completions" in e["path"]:
            out.append(e)
    return out


def main(folder: Path) -> None:
    res = json.loads((folder / "bench_gateway.json").read_text())
    rep, bare = events(folder / "replica_probe.jsonl"), events(folder / "bare_probe.jsonl")
    for name, phases in res["raw"].items():
        for i, r in enumerate(phases["32"]):
            t0 = r["t0_wall"]
            ev = [e for e in (bare if name.startswith("bare") else rep) if t0 <= e["arrival"] <= t0 + r["wall_s"]]
            if not ev:
                continue
            inside = sorted(e["first_byte"] - e["arrival"] for e in ev)
            client = sorted(t for _, t in r["samples"])
            wrap = [e["arrival"] - e["entry"] for e in ev if e.get("entry")]
            w = (f" | Serve wrapper (entry -> app) mean {statistics.mean(wrap) * 1e3:.1f} ms max {max(wrap) * 1e3:.1f}"
                 if wrap else "")
            print(f"{name:28s} r{i + 1}: client TTFT mean {statistics.mean(client):.2f} max {client[-1]:.2f} | inside "
                  f"mean {statistics.mean(inside):.2f} max {inside[-1]:.2f} | n {len(client)}/{len(inside)}{w}")
            for s, t in sorted(r["samples"], key=lambda x: -x[1])[:2]:
                near = sorted((e for e in ev if t0 + s - 0.01 <= e["arrival"] <= t0 + s + 3), key=lambda e: e["arrival"])
                if near:
                    e = max(near[:40], key=lambda e: e["first_byte"] - e["arrival"])
                    ent = f" entry +{e['entry'] - t0 - s:.2f}" if e.get("entry") else ""
                    print(f"      start {s:.2f} ttft {t:.2f}: slowest inside near it:{ent} arrived "
                          f"+{e['arrival'] - t0 - s:.2f} inside {e['first_byte'] - e['arrival']:.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/bgpr"))
