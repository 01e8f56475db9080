"""``lmfleet bench``: load generation, statistics and reports for OpenAI-compatible endpoints.

Layout: ``mix`` (workload mixes and their parsing), ``prompts`` (requests with synthesised prompts from a mix, a
dataset or a trace; ``workload`` names both), ``trace``, ``shapes`` and ``replay`` (timed traces: synthetic shapes,
replays of recorded traffic), ``loadgen`` (sending and timing), ``metrics`` (pure statistics), ``cost`` (prices and
the gateway ledger), ``report``/``html`` (outputs), ``sweep``, ``runner`` (one run end to end), and
``overflow_figures`` (the overflow-policies benchmark's figures).
"""

from lmfleet.bench.loadgen import LoadPlan, RequestRecord, Target, run_load
from lmfleet.bench.metrics import SLO, summarize
from lmfleet.bench.report import build_report, check_consistency
from lmfleet.bench.workload import BenchInputError, WorkloadMix, load_mix

__all__ = ["BenchInputError", "LoadPlan", "RequestRecord", "SLO", "Target", "WorkloadMix", "build_report",
           "check_consistency", "load_mix", "run_load", "summarize"]
