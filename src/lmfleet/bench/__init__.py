"""``lmfleet bench``: load generation, statistics and reports for OpenAI-compatible endpoints.

Layout: ``workload`` (mixes, prompt synthesis), ``loadgen`` (sending and timing), ``metrics`` (pure
statistics), ``cost`` (prices and the gateway ledger), ``report``/``html`` (outputs), ``sweep``, and
``runner`` (one run end to end).
"""

from lmfleet.bench.loadgen import LoadPlan, RequestRecord, Target, run_load
from lmfleet.bench.metrics import SLO, summarize
from lmfleet.bench.report import build_report, check_consistency
from lmfleet.bench.workload import BenchInputError, WorkloadMix, load_mix

__all__ = ["BenchInputError", "LoadPlan", "RequestRecord", "SLO", "Target", "WorkloadMix", "build_report",
           "check_consistency", "load_mix", "run_load", "summarize"]
