"""Timeouts against generation length, and Ray Serve queue settings against the expected burst.

Time per output token (TPOT) under load is estimated from the bytes one decode step reads::

    tpot = max(floor, load_factor * active_weight_bytes_per_gpu / (memory_bandwidth * 0.6))

with ``load_factor`` 2 (a busy batch roughly doubles single-stream TPOT), ``floor`` 20 ms on GPUs
(scheduling, sampling, all-reduce) and 30 ms on CPUs (FACTS: SmolLM2 measured ~37 ms at 8 concurrent
on 2 cores). ``--tpot-ms`` replaces the estimate with a measured figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmfleet.check.planner import MemoryPlan
from lmfleet.check.result import CheckResult, passed, warned
from lmfleet.config.models import FleetConfig, ModelConfig
from lmfleet.overflow.estimator import local_capacity

CPU_BANDWIDTH_GBS = 20.0
GPU_FLOOR_MS, CPU_FLOOR_MS, LOAD_FACTOR = 20.0, 30.0, 2.0
PROVIDER_TPOT_MS = 20.0
TTFT_ALLOWANCE_S = 5.0


@dataclass(frozen=True)
class LoadAssumptions:
    """What the checks assume about traffic; each has a CLI flag."""

    tpot_ms: float | None = None  # measured time per output token; None: estimate
    max_tokens: int | None = None  # longest generation clients ask for; None: max_model_len
    avg_tokens: int = 512  # typical generation, for queue waits
    burst: int | None = None  # concurrent requests at peak; None: 2x what min_replicas admit


def estimate_tpot_ms(plan: MemoryPlan | None, *, on_gpu: bool, bandwidth_gbs: float | None) -> float:
    if plan is None:
        return GPU_FLOOR_MS if on_gpu else CPU_FLOOR_MS * 2
    active = plan.weight_bytes_per_gpu * plan.params_active / max(plan.params_total, 1)
    bw = (bandwidth_gbs if on_gpu and bandwidth_gbs else CPU_BANDWIDTH_GBS) * 1e9 * 0.6
    return max(GPU_FLOOR_MS if on_gpu else CPU_FLOOR_MS, 1000 * LOAD_FACTOR * active / bw)


def check_timeouts(m: ModelConfig, cfg: FleetConfig, plan: MemoryPlan | None, la: LoadAssumptions, *,
                   on_gpu: bool, bandwidth_gbs: float | None = None) -> list[CheckResult]:
    subj, d, out = m.name, m.deployment, []
    tpot = la.tpot_ms or estimate_tpot_ms(plan, on_gpu=on_gpu, bandwidth_gbs=bandwidth_gbs)
    how = "given" if la.tpot_ms else "estimated"
    mml = plan.max_model_len if plan else (m.engine.max_model_len or 4096)
    max_tokens = la.max_tokens or mml
    longest = TTFT_ALLOWANCE_S + max_tokens * tpot / 1000
    if longest > d.request_timeout_s:
        cap = int((d.request_timeout_s - TTFT_ALLOWANCE_S) * 1000 / tpot)
        out.append(warned(
            "timeout.generation", subj,
            f"a {max_tokens}-token answer takes ~{longest:.0f} s ({how} {tpot:.0f} ms/token + {TTFT_ALLOWANCE_S:.0f} s "
            f"to first token) but request_timeout_s={d.request_timeout_s:g}: clients get 504 mid-generation",
            f"raise deployment.request_timeout_s to >= {math.ceil(longest * 1.2)} or cap max_tokens at ~{max(cap, 0)}",
            tpot_ms=tpot, max_tokens=max_tokens, needed_s=longest))
    else:
        out.append(passed("timeout.generation", subj,
                          f"{max_tokens} tokens x {tpot:.0f} ms ({how}) = ~{longest:.0f} s <= request_timeout_s "
                          f"{d.request_timeout_s:g}", tpot_ms=tpot))
    for p in cfg.providers:
        if m.name in p.model_map:
            remote = TTFT_ALLOWANCE_S + max_tokens * PROVIDER_TPOT_MS / 1000
            if remote > p.timeouts.total_s:
                out.append(warned("timeout.provider", subj,
                                  f"provider {p.name}: a {max_tokens}-token answer at ~{PROVIDER_TPOT_MS:.0f} ms/token takes "
                                  f"~{remote:.0f} s > timeouts.total_s={p.timeouts.total_s:g}",
                                  f"raise providers[{p.name}].timeouts.total_s to >= {math.ceil(remote * 1.2)}"))
    # queue: a burst beyond what the running replicas run at once waits (Ray Serve's or vLLM's queue)
    auto = d.autoscaling
    min_rep = d.min_replicas()
    admit = local_capacity(m)
    seqs = m.engine.max_num_seqs
    limit = (f"min(max_ongoing_requests={d.max_ongoing_requests}, max_num_seqs={seqs})" if seqs is not None
             else f"max_ongoing_requests={d.max_ongoing_requests}")
    burst = la.burst or 2 * admit
    typical = TTFT_ALLOWANCE_S + la.avg_tokens * tpot / 1000
    waves = max(0, math.ceil(burst / admit) - 1)
    wait = waves * typical
    overflow = m.overflow.enabled and any(m.name in p.model_map for p in cfg.providers)
    if auto and auto.target_ongoing_requests > d.max_ongoing_requests:
        out.append(warned("queue.autoscaling", subj,
                          f"autoscaling.target_ongoing_requests={auto.target_ongoing_requests:g} > max_ongoing_requests="
                          f"{d.max_ongoing_requests}: replicas cap out before the autoscaler sees the target",
                          f"set target_ongoing_requests below max_ongoing_requests (Ray suggests max ~20-50% above target)"))
    if wait + typical > d.request_timeout_s and not overflow:
        extra = (f"; autoscaling adds replicas only after upscale_delay_s={auto.upscale_delay_s:g} s plus model loading"
                 if auto else "")
        out.append(warned(
            "queue.burst", subj,
            f"a burst of {burst} requests against {admit} admitted at once ({min_rep} replica(s) x {limit}) queues "
            f"{waves} wave(s) of ~{typical:.0f} s ({la.avg_tokens} tokens): the last "
            f"wait ~{wait + typical:.0f} s > request_timeout_s={d.request_timeout_s:g}{extra}",
            "raise min_replicas, or max_ongoing_requests and max_num_seqs (if the KV cache allows), enable overflow "
            "to a provider, or raise request_timeout_s", burst=burst, admitted=admit, wait_s=wait))
    else:
        why = " (overflow to providers takes the excess)" if overflow and waves else ""
        out.append(passed("queue.burst", subj,
                          f"burst {burst} vs {admit} admitted: last request done in ~{wait + typical:.0f} s{why}",
                          burst=burst, admitted=admit))
    return out
