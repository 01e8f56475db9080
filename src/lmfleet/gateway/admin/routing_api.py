"""Admin routes of the routing state and its controls (admin key).

    GET    /admin/state                  the running fleet's version; per model: load, estimate, mode, replicas;
                                         per provider: breaker
    POST   /admin/overflow               a model's (or every model's) overflow mode, threshold, policy, prefill gate
                                         and miss floor, now
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.admin.ops import routing_state
from lmfleet.gateway.front.access import read_json
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.routing.router import ServedModel
from lmfleet.gateway.service import Gateway
from lmfleet.overflow import OverflowMode
from lmfleet.overflow.margin import check_floor
from lmfleet.overflow.policies import Policy, PolicyTimers

log = logging.getLogger("lmfleet.gateway")


def routing_routes(gw: Gateway, cfg: GatewayConfig) -> APIRouter:
    """``/admin/state`` and ``/admin/overflow`` for one gateway process."""
    r = APIRouter()

    @r.get("/admin/state")
    async def admin_state() -> dict[str, Any]:
        out: dict[str, Any] = {"fleet_version": gw.fleet_watch.version if gw.fleet_watch is not None else None,
                               "models": {}, "providers": {}}
        for n, m in gw.models.items():
            s = m.local.tracker.snapshot()
            out["models"][n] = {
                "ready": gw.health.is_ready(n), "health": gw.health.models[n].message,
                "running_replicas": gw.health.models[n].running_replicas,
                "in_flight": s.in_flight, "capacity": m.app.capacity,
                "queued_estimate": max(0, s.in_flight - m.app.capacity),
                "queue_estimate_ms": round(gw.router.estimate(m, s), 1), "threshold_ms": m.threshold_ms,
                "miss_margin_ms": round(m.margin.margin_for(m.threshold_ms, s), 1),
                "miss_floor": m.margin.floor,
                "mode": m.mode.value, "overflowing": m.hysteresis.overflowing, "drain_rps": s.drain_rps,
                "recent_ttft_s": s.ttft_s, "base_ttft_s": s.base_ttft_s,
                "engine_running": s.engine_running, "engine_waiting": s.engine_waiting,
                "pending_prefill_tokens": s.pending_prefill_tokens,
                "prefill_ms_per_1k_tokens": (round(s.prefill_s_per_token * 1e6, 1)
                                             if s.prefill_s_per_token is not None else None),
                "base_prefill_tokens": s.base_prefill_tokens, "prefill_stale": s.prefill_stale,
                "prefill_gate": ({"holding": m.local.gate.holding, "waiting": m.local.gate.waiting,
                                  "limit": m.local.gate.limit} if m.gated else None),
                "gate_service_line": ({"base_ms": round(s.gate_base_s * 1e3, 1), "base_tokens": s.gate_base_tokens,
                                       "ms_per_1k_tokens": round((s.gate_s_per_token or 0.0) * 1e6, 1)}
                                      if s.gate_base_s is not None else None),
                "gate_line": m.gate_line,
                "prefill_gate_setting": m.prefill_gate,
                "estimate_calibration": c.as_dict() if (c := gw.recorder.calibration.summary(n)) else None,
                **routing_state(gw, n, m.app.cfg.deployment.request_router),
            }
        for n, p in gw.providers.items():
            out["providers"][n] = {"breaker": p.breaker.state().value, "in_flight": p.in_flight,
                                   "retry_after_s": round(p.breaker.retry_after_s(), 2)}
        return out

    @r.post("/admin/overflow")
    async def admin_overflow(request: Request) -> dict[str, Any]:
        body = await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s)
        name = body.get("model")
        targets = list(gw.models.values()) if name in (None, "*") else [gw.router.model_or_404(str(name))]
        mode = body.get("mode")
        if mode is not None and mode not in {m.value for m in OverflowMode}:
            raise GatewayError(400, f"mode must be one of {[m.value for m in OverflowMode]}, got {mode!r}",
                               param="mode")
        thr = body.get("threshold_ms")
        if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or thr <= 0):
            raise GatewayError(400, f"threshold_ms must be a positive number, got {thr!r}", param="threshold_ms")
        gate = body.get("prefill_gate")
        if gate is not None and not isinstance(gate, bool) and gate != "auto":
            raise GatewayError(400, f"prefill_gate must be true, false or \"auto\", got {gate!r}",
                               param="prefill_gate")
        gate_line = body.get("gate_line")
        if gate_line is not None and not isinstance(gate_line, bool):
            raise GatewayError(400, f"gate_line must be true or false, got {gate_line!r}", param="gate_line")
        floor = body.get("miss_floor")
        if floor is not None:
            try:
                floor = check_floor(floor)
            except ValueError as e:
                raise GatewayError(400, str(e), param="miss_floor") from None
        timers = {m.name: _policy_timers(m, body) for m in targets}
        for m in targets:
            if mode is not None:
                m.mode = OverflowMode(mode)
            if thr is not None:
                m.threshold_ms = float(thr)
            m.timers = timers[m.name]
            if gate is not None:
                m.prefill_gate = gate
            if gate_line is not None:
                m.gate_line = gate_line
            if floor is not None:
                m.margin.floor = floor
        log.info("admin: overflow for %s set to mode=%s threshold_ms=%s policy=%s", [m.name for m in targets], mode,
                 thr, body.get("policy"))
        return {"models": {m.name: {"mode": m.mode.value, "threshold_ms": m.threshold_ms,
                                    "policy": m.timers.policy.value, "ttft_timeout_ms": m.timers.ttft_timeout_ms,
                                    "hedge_after_ms": m.timers.hedge_after_ms, "prefill_gate": m.prefill_gate,
                                    "prefill_gate_on": m.gated, "gate_line": m.gate_line,
                                    "miss_floor": m.margin.floor}
                           for m in targets}}

    return r


def _policy_timers(m: ServedModel, body: dict[str, Any]) -> PolicyTimers:
    """``overflow.policy`` and its timers from the body (keys left out: as they are now); 400 when invalid."""
    if not {"policy", "ttft_timeout_ms", "hedge_after_ms"} & body.keys():
        return m.timers
    t = m.timers
    policy = body.get("policy", t.policy.value)
    if policy not in {p.value for p in Policy}:
        raise GatewayError(400, f"policy must be one of {[p.value for p in Policy]}, got {policy!r}",
                           param="policy")
    if policy != Policy.PREDICTIVE.value and not m.providers:
        raise GatewayError(400, f"policy {policy} needs a provider, and no provider maps {m.name!r}",
                           param="policy")
    try:
        return PolicyTimers(Policy(policy), body.get("ttft_timeout_ms", t.ttft_timeout_ms),
                            body.get("hedge_after_ms", t.hedge_after_ms))
    except (ValueError, TypeError) as e:
        raise GatewayError(400, str(e), param="policy") from None
