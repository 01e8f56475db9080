"""``lmfleet bench run --trace``: a recorded trace replayed at its (paced) times with prompts of its lengths, against
the fast fake server (fixture: tests/unit/data/azure_trace/, an excerpt of the Azure LLM inference trace 2023,
CC-BY 4.0)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmfleet.bench.loadgen import LoadPlan, Target, run_load, trace_gaps
from lmfleet.bench.trace import TraceRequest
from lmfleet.bench.workload import BenchInputError, BenchRequest, PromptSynthesizer, trace_requests
from lmfleet.cli.bench import app, build_spec
from lmfleet.testing.fast_openai_server import FastServer

EXCERPT = Path(__file__).parent / "data" / "azure_trace" / "AzureLLMInferenceTrace_code_excerpt.csv"
runner = CliRunner()


@pytest.fixture(scope="module")
def server():
    with FastServer("--served-by", "local/fast", "--max-model-len", "1024") as srv:
        yield srv


@pytest.fixture(scope="module")
def synth():
    from transformers import AutoTokenizer

    from lmfleet.models import resolve_source

    return PromptSynthesizer(AutoTokenizer.from_pretrained(resolve_source("builtin:tiny-random",
                                                                          progress=lambda *_: None)))


def spec_for(trace: str, **kw):
    base = dict(url="http://x", model="m", api_key=None, users=None, rate=None, burstiness=1.0, think="0",
                ramp_up=0.0, duration=None, requests=None, warmup=0.0, max_conc=None, mix="a:1:10:5",
                weight=[], dataset=None, dataset_api="chat", tokenizer=None, seed=0, no_stream=False,
                ignore_eos=False, slo_ttft=None, slo_tpot=None, slo_e2el=None, price=[], no_ledger=True,
                timeout=60.0)
    return build_spec(**{**base, **kw}, trace=trace)


def test_gaps_of_recorded_arrivals():
    assert list(itertools.islice(trace_gaps([0.5, 0.5, 2.0]), 5)) == [0.5, 0.0, 1.5, 0.0, 0.0]


def test_a_trace_sets_the_plan_from_its_arrivals():
    spec = spec_for(f"azure:{EXCERPT}:speed=2:requests=12")
    p = spec.plan
    assert p.users is None and p.num_requests == 12 and p.duration is None and len(p.arrivals) == 12
    assert p.arrivals[1] == pytest.approx(0.052 / 2) and p.rate == pytest.approx(12 / (p.arrivals[-1]))
    assert spec.mix is None and spec.trace.speed == 2.0
    assert spec_for(f"azure:{EXCERPT}", requests=5).plan.num_requests == 5  # -n cuts the replay short


@pytest.mark.parametrize("kw,message", [
    (dict(users=4), "drop --users"), (dict(rate=2.0), "drop --users"), (dict(weight=["a=1"]), "drop --users"),
    (dict(), "load= is a multiple of a measured capacity"),
])
def test_trace_conflicts(kw, message):
    with pytest.raises(BenchInputError, match=message):
        spec_for(f"azure:{EXCERPT}:load=2" if not kw else f"azure:{EXCERPT}", **kw)


def test_trace_requests_have_the_recorded_lengths_above_the_template_floor(synth):
    trace = [TraceRequest(0, 0.0, 40, 7, "trace"), TraceRequest(1, 0.1, 1, 3, "trace")]
    chat = trace_requests(trace, synth, "chat", seed=1)
    floor = synth.min_tokens("chat")
    assert [(r.input_tokens, r.max_tokens, r.api) for r in chat] == [(40, 7, "chat"), (floor, 3, "chat")]
    assert synth.count_messages(chat[0].messages) == 40 and not chat[0].ignore_eos
    done = trace_requests(trace, synth, "completion", ignore_eos=True)
    assert synth.count_completion(done[0].prompt) == 40 and done[0].ignore_eos
    with pytest.raises(BenchInputError, match="expected chat or completion"):
        trace_requests(trace, synth, "embeddings")


def test_run_load_sends_at_the_recorded_times(server):
    arrivals = (0.2, 0.2, 0.5, 0.9)
    reqs = [BenchRequest("trace", "chat", 2, 3, messages=[{"role": "user", "content": "hi"}])]
    records, wall = asyncio.run(run_load(Target(server.base_url, "fast"), reqs,
                                         LoadPlan(rate=4.4, num_requests=4, arrivals=arrivals)))
    starts = sorted(r.start for r in records)
    assert len(records) == 4 and all(r.ok for r in records)
    for got, want in zip(starts, arrivals):
        assert want - 0.01 <= got <= want + 0.15


def test_cli_replays_a_trace(server, tmp_path):
    result = runner.invoke(app, ["run", "--url", server.base_url, "--model", "fast", "--tokenizer",
                                 "builtin:tiny-random", "--trace", f"azure:{EXCERPT}:requests=8:speed=10:tokens=0.1",
                                 "--quiet", "--no-ledger", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["overall"]["requests"] == 8 and report["overall"]["failed"] == 0
    meta = report["meta"]
    assert "trace AzureLLMInferenceTrace_code_excerpt.csv" in meta["workload"] and "tokens x 0.1" in meta["workload"]
    assert "CC-BY 4.0" in meta["workload"] and "the trace's arrivals" in meta["load"]
