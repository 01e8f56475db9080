"""`lmfleet bench` through the real CLI against the real gateway and vLLM engine (the shared `fleet`)."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

MIX = "short-chat:0.6:40-120:8-24:chat,long-completion:0.4:300-600:8-16:completion"


def run_cli(base_url: str, model: str, out: Path, api_key: str | None = None,
            admin_key: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LMFLEET_BENCH_API_KEY": api_key or "", "LMFLEET_ADMIN_KEY": admin_key or ""}
    cmd = [sys.executable, "-m", "lmfleet.cli.main", "bench", "run", "--url", base_url, "--model", model,
           "--tokenizer", "builtin:smollm2", "--users", "4", "--requests", "16", "--mix", MIX, "--seed", "1",
           "--price", "local=0.05:0.10", "--price", "provider=0.5:1.5", "--price", "*=0.05:0.10",
           "--slo-ttft-ms", "60000", "--quiet", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def check_report_files(out: Path) -> dict:
    """Every format exists and agrees with itself and with the others."""
    report = json.loads((out / "report.json").read_text())
    o = report["overall"]
    assert o["requests"] == 16 and o["completed"] + o["failed"] == 16
    assert o["completed"] >= 15, o["errors_by_status"]
    for section in ("providers", "classes"):
        for key in ("requests", "completed", "failed", "input_tokens", "output_tokens"):
            assert sum(g[key] for g in report[section].values()) == o[key], (section, key)
    assert set(report["classes"]) <= {"short-chat", "long-completion"}
    assert o["output_tokens"] > 0 and o["output_throughput"] > 0 and o["ttft_ms"]["p50"] > 0
    assert o["ttft_ms"]["p50"] <= o["e2el_ms"]["p50"] and o["e2el_ms"]["p99"] <= o["e2el_ms"]["max"]
    assert o["usd_per_1m_output"] is not None
    rows = {(r["scope"], r["group"], r["metric"]): r["value"] for r in csv.DictReader((out / "report.csv").open())}
    assert int(rows[("overall", "all", "output_tokens")]) == o["output_tokens"]
    for provider, s in report["providers"].items():
        assert int(rows[("provider", provider, "requests")]) == s["requests"]
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert all(p in page for p in report["providers"])
    return report


def check_exact_prompt_tokens(base_url: str, model: str, api_key: str | None = None) -> None:
    """Synthesised prompts have exactly the asked token count, as the engine counts them (usage)."""
    from transformers import AutoTokenizer

    from lmfleet.bench.loadgen import LoadPlan, Target, run_load
    from lmfleet.bench.workload import PromptSynthesizer, parse_mix_inline, sample_requests
    from lmfleet.models import resolve_source

    synth = PromptSynthesizer(AutoTokenizer.from_pretrained(resolve_source("builtin:smollm2")))
    reqs = sample_requests(parse_mix_inline("c:0.5:40-200:2:chat,p:0.5:40-200:2:completion"), 4, synth, seed=5)
    records, _ = asyncio.run(run_load(Target(base_url, model, api_key), reqs, LoadPlan(users=1, num_requests=4)))
    assert all(r.ok for r in records)
    # compare where the engine itself answered (an external provider may tokenise differently)
    pairs = [(r.prompt_tokens, q.input_tokens) for r, q in zip(records, reqs) if not r.provider.startswith("provider/")]
    assert pairs and all(got == want for got, want in pairs), pairs


def test_bench_run_through_gateway(fleet, tmp_path):
    model = fleet.models[0]
    result = run_cli(fleet.base_url, model, tmp_path, fleet.api_key, fleet.admin_key)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Throughput (output tok/s)" in result.stdout
    report = check_report_files(tmp_path)
    # through the gateway every answer names who served it (local/NAME or provider/NAME)
    assert all(p.startswith(("local/", "provider/")) for p in report["providers"]), list(report["providers"])
    # the gateway has a ledger: cost comes from it, and it saw our requests
    assert report["meta"]["cost_source"] == "ledger"
    assert all(s["cost_source"] == "ledger" for s in report["providers"].values())
    # the engine must answer these: on a busy machine the bench's long prompts can push the local estimate over
    # the overflow threshold, and the provider's answers are not compared
    assert fleet.admin("POST", "/admin/overflow", json={"model": model, "mode": "force_off"}).status_code == 200
    try:
        check_exact_prompt_tokens(fleet.base_url, model, fleet.api_key)
    finally:
        fleet.admin("POST", "/admin/overflow", json={"model": model, "mode": "auto"})


def test_bench_bad_model_exits_2_without_load(fleet, tmp_path):
    result = run_cli(fleet.base_url, "no-such-model", tmp_path, fleet.api_key)
    assert result.returncode == 2 and "is not served" in result.stderr
    assert not (tmp_path / "report.json").exists()
