"""Checks of ``deployment.request_router`` that need the whole fleet file (other sections' keys).

A router choice can be valid on its own and still useless or refused by Ray given another section:
``kv_aware`` needs direct streaming (``gateway.serve_proxy: haproxy``), and both cache-aware routers
need the engines' prefix cache. :func:`routing_problems` lists such combinations, each with the key
path the loader reports (file line and all) and a message naming both keys. It imports nothing from
``lmfleet.config.fleet`` so that ``FleetConfig`` can call it without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

CACHE_AWARE = ("prefix_aware", "kv_aware")


@dataclass(frozen=True)
class RoutingProblem:
    loc: tuple[str | int, ...]
    message: str
    value: Any


def routing_problems(fleet: Any) -> list[RoutingProblem]:
    """Router choices that contradict another key of ``fleet`` (a ``FleetConfig``)."""
    problems = []
    for i, m in enumerate(fleet.models):
        router = m.deployment.request_router
        loc = ("models", i, "deployment", "request_router")
        if router == "kv_aware" and fleet.gateway.serve_proxy != "haproxy":
            problems.append(RoutingProblem(loc, (
                f"model {m.name!r}: request_router kv_aware needs Ray Serve LLM's direct streaming, but "
                f"gateway.serve_proxy is {fleet.gateway.serve_proxy!r}; set gateway.serve_proxy: haproxy or choose "
                "another request_router (e.g. prefix_aware)"), router))
        if router in CACHE_AWARE and m.engine.enable_prefix_caching is False:
            problems.append(RoutingProblem(loc, (
                f"model {m.name!r}: request_router {router} sends requests where their prefix is cached, but "
                "engine.enable_prefix_caching is false; turn prefix caching on (or leave it null) or use "
                "request_router: default"), router))
    return problems


def routing_validation_error(problems: list[RoutingProblem]) -> ValidationError:
    """``problems`` as one ``ValidationError`` with a ``loc`` each (raised from ``FleetConfig``'s validator)."""
    return ValidationError.from_exception_data("FleetConfig", [
        InitErrorDetails(type=PydanticCustomError("request_router", "{message}", {"message": p.message}),
                         loc=p.loc, input=p.value)
        for p in problems])
