"""``deployment.request_router`` mapped onto Ray Serve's request routers (docs/routing.md).

What Ray Serve 2.60 provides, and what each name here selects:

==============  =====================================================================  ===========================
request_router  Ray class (``request_router_config.request_router_class``)             kwargs (``initialize_state``)
==============  =====================================================================  ===========================
default         ``PowerOfTwoChoicesRequestRouter``: the less loaded of two random       none (not set at all)
                replicas (Serve's default; we leave ``request_router_config`` unset)
prefix_aware    ``lmfleet.engine.prefix_router.PrefixAffinityRouter``: Ray's           imbalanced_threshold,
                ``PrefixCacheAffinityRouter`` plus the pick-only path of direct        match_rate_threshold,
                streaming, where Ray's class never learns where prompts went           do_eviction, eviction_*
kv_aware        ``ray.serve.llm.request_router.KVAwareRouter`` (alpha): scores          none; Ray also turns on the
                replicas on the engines' KV-cache events through ai-dynamo's            engines' KV events
                ``SelectionService`` in the direct-streaming ingress router
round_robin     ``ray.serve.experimental.round_robin_router.RoundRobinRouter``         none
==============  =====================================================================  ===========================

The hot-spot guard is PrefixCacheAffinityRouter's own ``imbalanced_threshold``: before it looks at
prefixes it reads the candidate replicas' queue lengths (requests in flight per replica, Serve's
cached probe values; on the direct-streaming path, a fresh probe plus the picks made since) and, when
``max - min > imbalanced_threshold``, ignores prefixes and picks the less loaded replica. Ray's default is
``inf`` (no guard); ours is ``prefix_aware.imbalance_threshold`` (4).

Direct streaming (``gateway.serve_proxy: haproxy``): HAProxy asks Serve's ingress router where to
send each request, and by default does not forward the request body to it, so a router that reads
the prompt (prefix_aware, kv_aware) sees none and falls back to load balancing. :func:`routing_env`
is the switch that forwards it (``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1``); it must be in
the environment of the processes that start Ray and Serve, like the other direct-streaming switches.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lmfleet.config.models import DeploymentConfig, FleetConfig, ModelConfig
from lmfleet.errors import LmfleetError

ROUTER_CLASSES = {
    # Ray's PrefixCacheAffinityRouter (ray.serve.llm.request_router), fixed for direct streaming
    "prefix_aware": "lmfleet.engine.prefix_router.PrefixAffinityRouter",
    "kv_aware": "ray.serve.llm.request_router.KVAwareRouter",
    "round_robin": "ray.serve.experimental.round_robin_router.RoundRobinRouter",
}
"""Ray's class per ``request_router`` (``default``: none, Serve's PowerOfTwoChoicesRequestRouter)."""

BODY_AWARE = frozenset({"prefix_aware", "kv_aware"})
"""Routers that decide on the request's prompt."""

FORWARD_BODY = "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"


class RouterUnavailable(LmfleetError, RuntimeError):
    """The configured router cannot run in this installation; the message says what to install or change."""


def request_router_config(dep: DeploymentConfig) -> dict[str, Any] | None:
    """``deployment_config.request_router_config`` for Ray Serve, or None for Serve's default router."""
    cls = ROUTER_CLASSES.get(dep.request_router)
    if cls is None:
        return None
    out: dict[str, Any] = {"request_router_class": cls}
    if dep.request_router == "prefix_aware":
        out["request_router_kwargs"] = prefix_aware_kwargs(dep)
    return out


def prefix_aware_kwargs(dep: DeploymentConfig) -> dict[str, Any]:
    """PrefixCacheAffinityRouter's ``initialize_state`` kwargs (JSON-safe: Ray serialises them)."""
    o = dep.prefix_aware_options()
    kw: dict[str, Any] = {"match_rate_threshold": o.match_rate_threshold, "do_eviction": o.evict_above_chars is not None}
    if o.imbalance_threshold is not None:  # unset: Ray's default, inf (float("inf") is not JSON)
        kw["imbalanced_threshold"] = o.imbalance_threshold
    if o.evict_above_chars is not None:
        kw |= {"eviction_threshold_chars": o.evict_above_chars, "eviction_target_chars": o.evict_to_chars,
               "eviction_interval_secs": o.eviction_interval_s}
    return kw


def routing_env(fleet: FleetConfig) -> dict[str, str]:
    """Environment the Ray/Serve processes need for the fleet's routers: with direct streaming and a router that
    reads the prompt, HAProxy must forward request bodies to Serve's ingress router (else it routes blind)."""
    if fleet.gateway.serve_proxy == "haproxy" and any(m.deployment.request_router in BODY_AWARE for m in fleet.models):
        return {FORWARD_BODY: "1"}
    return {}


def check_router_available(model: ModelConfig, find_spec=importlib.util.find_spec) -> None:
    """Raise :class:`RouterUnavailable` when the model's router needs a package that is not installed."""
    if model.deployment.request_router == "kv_aware" and find_spec("dynamo") is None:
        raise RouterUnavailable(
            f"model {model.name!r}: request_router kv_aware needs the ai-dynamo package (Ray's KVAwareRouter scores "
            "replicas with dynamo.llm.SelectionService), which is not installed; install it or use "
            "request_router: prefix_aware")
