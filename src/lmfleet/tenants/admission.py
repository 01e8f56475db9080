"""Admission per tenant and priority class: run locally now, wait locally, send to a provider, or refuse.

Order of the checks (first match wins)::

    in flight >= limits.max_concurrency                 -> reject 429  "concurrency_limit"
    requests window has no room for one more            -> reject 429  "requests_per_minute"
    tokens window has no room for the prompt (*)        -> reject 429  "tokens_per_minute"
    estimate_ms <= threshold_ms                         -> local now   "local_ok"
    class without max_wait_s (interactive)
        a provider may take it                          -> provider    "over_threshold"
        else                                            -> local wait  "no_provider" (queued as today)
    class with max_wait_s (batch)
        estimate_ms <= max_wait_s                       -> local wait  "within_deadline" (deadline attached)
        tenant may pay and a provider may take it       -> provider    "over_deadline"
        else                                            -> reject 429  "deadline"

(*) an empty tokens window admits any prompt, so one request larger than the whole limit still runs once.
"A provider may take it" is ``provider_ok`` (the caller's answer from the breakers, provider capacity and
the fleet budget, i.e. ``overflow.decide`` under pressure) and the tenant's own budget
(``budget_left_usd``, None: no tenant cap). Every decision carries OpenAI's rate-limit headers for the
limits the tenant has; a refusal adds ``retry-after`` and an OpenAI-shaped body.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lmfleet.errors import LmfleetError, openai_error_body
from lmfleet.config.tenants import PriorityClass, TenantLimits
from lmfleet.overflow.policy import Reason
from lmfleet.tenants.directory import Tenant
from lmfleet.tenants.window import RateWindow, format_duration

__all__ = [
    "PRIORITY_HEADER",
    "Admission",
    "Outcome",
    "PriorityHeaderError",
    "Reason",
    "TenantUsage",
    "admit",
    "model_refusal",
    "rate_limit_headers",
    "requested_class",
]

PRIORITY_HEADER = "x-lmfleet-priority"


class PriorityHeaderError(LmfleetError, ValueError):
    """The x-lmfleet-priority header names no class: the gateway answers 400 with :meth:`body`."""

    status = 400

    def __init__(self, value: str, classes: Sequence[str]):
        self.message = (f"Unknown priority class {value[:40]!r} in the {PRIORITY_HEADER} header; "
                        f"expected one of {list(classes)}.")
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return openai_error_body(self.message, "invalid_request_error", PRIORITY_HEADER, "invalid_priority")


def requested_class(header_value: str | None, tenant: Tenant, classes: Sequence[PriorityClass]) -> PriorityClass:
    """The class of one request: the header's (case and spaces ignored), capped at the tenant's
    ``max_priority``; the tenant's default when the header is absent or empty."""
    value = (header_value or "").strip().lower()
    if not value:
        return tenant.priority
    chosen = next((c for c in classes if c.name == value), None)
    if chosen is None:
        raise PriorityHeaderError(value, [c.name for c in classes])
    return tenant.max_priority if chosen.order < tenant.max_priority.order else chosen


def model_refusal(tenant: Tenant, model: str) -> dict[str, Any] | None:
    """A 403 body when ``tenant`` may not use ``model``; None when it may."""
    if tenant.may_use(model):
        return None
    return openai_error_body(f"The model {model!r} is not available to tenant {tenant.name!r}. Its models: "
                       f"{sorted(tenant.models)}.", "permission_error", "model", "model_not_allowed")


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's rate windows (None where it has no such limit). Immutable: ``record_*`` return the next."""

    requests: RateWindow | None = None
    tokens: RateWindow | None = None

    @classmethod
    def for_limits(cls, limits: TenantLimits, window_s: float = 60.0) -> "TenantUsage":
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        return cls(RateWindow(rpm, window_s) if rpm else None, RateWindow(tpm, window_s) if tpm else None)

    def record_request(self, now: float) -> "TenantUsage":
        return self if self.requests is None else replace(self, requests=self.requests.add(now))

    def record_tokens(self, now: float, tokens: int) -> "TenantUsage":
        return self if self.tokens is None or tokens <= 0 else replace(self, tokens=self.tokens.add(now, tokens))


class Outcome(str, enum.Enum):
    LOCAL_NOW = "local_now"
    LOCAL_WAIT = "local_wait"
    PROVIDER = "provider"
    REJECT = "reject"


@dataclass(frozen=True)
class Admission:
    """One request's admission: where it goes, why, and the headers to answer with."""

    outcome: Outcome
    reason: Reason
    priority: str
    """The class it was admitted in (x-lmfleet-priority on the answer)."""
    headers: dict[str, str] = field(default_factory=dict)
    """OpenAI's x-ratelimit-* for the tenant's limits; on a refusal also retry-after."""
    deadline_s: float | None = None
    """LOCAL_WAIT: the longest it may wait in the local queue (None: no deadline, as today)."""
    retry_after_s: float | None = None
    message: str | None = None

    @property
    def status(self) -> int | None:
        return 429 if self.outcome is Outcome.REJECT else None

    def body(self) -> dict[str, Any] | None:
        """The 429 body (OpenAI's shape: ``type`` ``requests``/``tokens`` for rate limits); None if admitted."""
        if self.outcome is not Outcome.REJECT:
            return None
        kind = {Reason.REQUESTS_PER_MINUTE: "requests", Reason.TOKENS_PER_MINUTE: "tokens"}.get(self.reason)
        code = {Reason.CONCURRENCY_LIMIT: "concurrency_limit_exceeded", Reason.DEADLINE: "queue_deadline_exceeded"}
        return openai_error_body(self.message or "Rate limit reached.", kind or "rate_limit_error", None,
                           code.get(self.reason, "rate_limit_exceeded"))


def rate_limit_headers(usage: TenantUsage, now: float) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the windows the tenant has."""
    out: dict[str, str] = {}
    for kind, w in (("requests", usage.requests), ("tokens", usage.tokens)):
        if w is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(w.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(w.remaining(now))
            out[f"x-ratelimit-reset-{kind}"] = format_duration(w.reset_s(now))
    return out


def _reject(reason: Reason, cls: PriorityClass, headers: dict[str, str], retry_s: float, message: str) -> Admission:
    retry_s = max(1.0, retry_s)
    return Admission(Outcome.REJECT, reason, cls.name, {**headers, "retry-after": str(math.ceil(retry_s))},
                     retry_after_s=retry_s, message=f"{message} Please try again in {format_duration(retry_s)}.")


def admit(tenant: Tenant, cls: PriorityClass, *, usage: TenantUsage, in_flight: int, estimate_ms: float,
          threshold_ms: float, provider_ok: bool, budget_left_usd: float | None, now: float,
          prompt_tokens: int = 0) -> Admission:
    """Admit one request of ``tenant`` in class ``cls`` (see the module docstring for the rules).

    ``usage``: the tenant's windows before this request (the caller records it when admitted);
    ``in_flight``: the tenant's requests running or queued now; ``estimate_ms`` and ``threshold_ms``: the
    route's weighed estimate and its bar (:mod:`lmfleet.gateway.routing.decision` states the one threshold
    semantics: the predicted wait plus the miss margin, against the threshold with hysteresis applied);
    ``prompt_tokens``: what the tokens window must have room for.
    """
    headers = rate_limit_headers(usage, now)
    limit = tenant.limits.max_concurrency
    if limit is not None and in_flight >= limit:
        return _reject(Reason.CONCURRENCY_LIMIT, cls, headers, 1.0,
                       f"Tenant {tenant.name!r} has {in_flight} requests in flight; its limit is {limit}.")
    if usage.requests is not None and not usage.requests.allows(now):
        w = usage.requests
        return _reject(Reason.REQUESTS_PER_MINUTE, cls, headers, w.retry_after_s(now),
                       f"Rate limit reached for tenant {tenant.name!r} on requests per min (RPM): "
                       f"Limit {w.limit}, Used {math.ceil(w.used(now) - 1e-9)}, Requested 1.")
    if usage.tokens is not None and usage.tokens.used(now) > 0 and not usage.tokens.allows(now, prompt_tokens):
        w = usage.tokens
        return _reject(Reason.TOKENS_PER_MINUTE, cls, headers, w.retry_after_s(now, prompt_tokens),
                       f"Rate limit reached for tenant {tenant.name!r} on tokens per min (TPM): "
                       f"Limit {w.limit}, Used {math.ceil(w.used(now) - 1e-9)}, Requested {prompt_tokens}.")
    if estimate_ms <= threshold_ms:
        return Admission(Outcome.LOCAL_NOW, Reason.LOCAL_OK, cls.name, headers)
    may_pay = provider_ok and (budget_left_usd is None or budget_left_usd > 0)
    if cls.max_wait_s is None:
        if may_pay:
            return Admission(Outcome.PROVIDER, Reason.OVER_THRESHOLD, cls.name, headers)
        return Admission(Outcome.LOCAL_WAIT, Reason.NO_PROVIDER, cls.name, headers)
    if estimate_ms <= cls.max_wait_s * 1000:
        return Admission(Outcome.LOCAL_WAIT, Reason.WITHIN_DEADLINE, cls.name, headers, deadline_s=cls.max_wait_s)
    if may_pay and tenant.batch_may_use_providers:
        return Admission(Outcome.PROVIDER, Reason.OVER_DEADLINE, cls.name, headers)
    return _reject(Reason.DEADLINE, cls, headers, (estimate_ms - cls.max_wait_s * 1000) / 1000,
                   f"The local queue is too long for class {cls.name!r}: predicted wait {estimate_ms / 1000:.0f} s, "
                   f"its deadline is {cls.max_wait_s:g} s.")
