"""A longer property-based fuzz run of the gateway's OpenAI routes than the unit test's.

    .venv/bin/python benchmarks/fuzz_gateway.py --examples 20000 --seed 1

Same generator and properties as tests/unit/test_gateway_fuzz.py (``lmfleet.testing.gateway_fuzz``) (never a 5xx, every error OpenAI-shaped, no
local slot left in flight, every request counted in the metrics), against the real gateway (build_gateway) with
a fake local deployment over real HTTP. Prints one JSON line: requests, seconds, status counts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lmfleet.testing.gateway_fuzz import run_fuzz


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=20_000, help="generated requests per seed")
    ap.add_argument("--seed", type=int, action="append", help="hypothesis seed (repeatable; default 1)")
    ap.add_argument("--smoke", action="store_true", help="a few seconds: 30 requests, checks that the run works")
    args = ap.parse_args()
    if args.smoke:
        args.examples = 30
    for seed in args.seed or [1]:
        report: dict = {"seed": seed}
        with tempfile.TemporaryDirectory() as tmp:
            run_fuzz(Path(tmp), args.examples, seed=seed, report=report)
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
