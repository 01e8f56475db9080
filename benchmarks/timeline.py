"""When each request of a 32-stream phase started and got its first token, from a bench_gateway.py JSON.

    .venv/bin/python benchmarks/timeline.py out/bench_gateway.json [--path "lmfleet gateway"] [--bin-s 0.1]

bench_gateway's 32-stream phase is closed-loop (32 workers, 96 requests): the requests come in waves. On bare
vLLM every request of a wave finishes in the same engine step, so the next wave starts together and is prefilled
in one step (TTFT P99 ~ P50). Where the waves come apart, requests that start while others decode wait longer,
and P99 (with 96 samples, nearly the maximum) is one of those. This prints, per path and phase, the starts and
first tokens grouped into ``--bin-s`` bins ("1.4x31": 31 requests at 1.4 s), then the phase's slowest requests,
so two paths' phases can be compared side by side (docs/benchmarks.md, session 13).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def clumps(times: list[float], bin_s: float) -> str:
    """``times`` grouped into bins of ``bin_s`` seconds: "0.1x1 1.4x31" (bin start x count), in time order."""
    c = Counter(round(round(t / bin_s) * bin_s, 3) for t in times)
    return " ".join(f"{k:g}x{v}" for k, v in sorted(c.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("--path", action="append", help="only this path (repeatable); default: all")
    ap.add_argument("--bin-s", type=float, default=0.1)
    ap.add_argument("--slowest", type=int, default=4)
    args = ap.parse_args()
    raw = json.loads(args.json.read_text())["raw"]
    for name, phases in raw.items():
        if args.path and name not in args.path:
            continue
        for i, r in enumerate(phases.get("32", [])):
            s = r.get("samples")
            if not s:
                print(f"{name} round {i + 1}: no per-request samples (bench_gateway.py before 2026-12-02)")
                continue
            print(f"{name} round {i + 1}: TTFT P50 {r['ttft_p50_ms']:.0f} ms, P99 {r['ttft_p99_ms']:.0f} ms, "
                  f"{r['output_tok_s']:.0f} tok/s over {r['wall_s']:.1f} s")
            print("  starts:       " + clumps([a for a, _ in s], args.bin_s))
            print("  first tokens: " + clumps([a + b for a, b in s], args.bin_s))
            slow = sorted(s, key=lambda x: -x[1])[: args.slowest]
            print("  slowest (start -> TTFT s): " + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in slow))


if __name__ == "__main__":
    main()
