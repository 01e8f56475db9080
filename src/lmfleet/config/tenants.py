"""Config models for tenants (who holds which keys, with what limits) and priority classes (who waits).

Two top-level keys of ``fleet.yaml``::

    priority_classes:            # ordered by ``order``: lower goes first (default: interactive, batch)
      - {name: interactive, order: 0}                    # no max_wait_s: overflow at the model's threshold
      - {name: batch, order: 10, max_wait_s: 600}        # waits locally up to 600 s
    tenants:
      - name: acme
        api_keys_env: ACME_KEYS  # or api_keys_file (exactly one; keys are never inline)
        limits: {requests_per_minute: 600, tokens_per_minute: 200000, max_concurrency: 16, daily_usd: 20}
        models: [smollm2]        # empty: every served model
        priority: batch          # the class of a request without an x-lmfleet-priority header
        max_priority: interactive  # the most urgent class the header may ask for (null: ``priority``)

This module imports nothing from ``lmfleet.config.fleet`` so that ``FleetConfig`` can hang these in
without an import cycle; :func:`check_tenants` does the checks that need the whole file (model names,
class names, duplicates) on any object shaped like ``FleetConfig`` (:class:`FleetLike`).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from pydantic import AfterValidator, Field, StrictBool, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from lmfleet.config.base import Strict

__all__ = [
    "DEFAULT_TENANT",
    "FleetLike",
    "PriorityClass",
    "PriorityClassList",
    "TenantConfig",
    "TenantLimits",
    "TenantProblem",
    "TenantSettings",
    "TenantUpdate",
    "check_settings",
    "check_tenants",
    "default_priority_classes",
    "tenant_validation_error",
]

_LABEL_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""Tenant and class names: safe as a Prometheus label, a ledger value and a spend-cap key (no ',' or ':')."""
_ENV_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"

DEFAULT_TENANT = "default"
"""The tenant that the flat ``gateway.api_keys_env``/``api_keys_file`` keys (or an open gateway) become."""


class PriorityClass(Strict):
    """One priority class: where it stands in the local queue and how long it may wait there."""

    name: str = Field(..., pattern=_LABEL_RE, description="Class name, as sent in the x-lmfleet-priority header.")
    order: int = Field(..., ge=0, le=1000, description="Dispatch order in the local queue: lower goes first.")
    max_wait_s: float | None = Field(
        None, gt=0, le=86400, description="Local wait deadline. Null: the class overflows like today (local while "
        "the predicted wait is under the model's overflow.threshold_ms, else a provider). Set: requests wait "
        "locally up to this long, go to a paid provider only when their tenant has batch_may_use_providers, "
        "else get 429.")


def default_priority_classes() -> list[PriorityClass]:
    """``interactive`` (overflows at the threshold, as today) before ``batch`` (waits up to 10 minutes)."""
    return [PriorityClass(name="interactive", order=0), PriorityClass(name="batch", order=10, max_wait_s=600.0)]


def _check_classes(classes: list[PriorityClass]) -> list[PriorityClass]:
    if not classes:
        raise ValueError("needs at least one class; omit priority_classes for the defaults (interactive, batch)")
    names = [c.name for c in classes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"class names must be unique; repeated: {dupes}")
    orders = [c.order for c in classes]
    same = sorted({o for o in orders if orders.count(o) > 1})
    if same:
        raise ValueError(f"class orders must be distinct (a header is capped by comparing them); repeated: {same}")
    return sorted(classes, key=lambda c: c.order)


PriorityClassList = Annotated[list[PriorityClass], AfterValidator(_check_classes)]
"""Priority classes, validated (unique names and orders) and sorted most urgent first."""


class TenantLimits(Strict):
    """What one tenant may use; every limit is optional (null: unlimited)."""

    requests_per_minute: int | None = Field(None, ge=1, description="Requests admitted per rolling minute.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Input + output tokens per rolling minute (counted from usage; a request is "
        "admitted while the window has room for its prompt).")
    max_concurrency: int | None = Field(None, ge=1, description="Requests of this tenant in flight at once.")
    hourly_usd: float | None = Field(None, ge=0, description="External-provider spend cap per rolling hour (USD).")
    daily_usd: float | None = Field(None, ge=0, description="External-provider spend cap per rolling day (USD).")


class TenantConfig(Strict):
    """One tenant: its keys, its limits, the models it may use and its priority classes."""

    name: str = Field(..., pattern=_LABEL_RE, description="Tenant name (ledger, metrics label, admin API).")
    api_keys_env: str | None = Field(
        None, pattern=_ENV_RE, description="Env var holding the tenant's comma-separated API keys.")
    api_keys_file: str | None = Field(None, min_length=1, description="File with one API key per line (# comments).")
    limits: TenantLimits = Field(default_factory=TenantLimits, description="Rate, concurrency and spend limits.")
    models: list[str] = Field(default_factory=list, description="Models the tenant may use. Empty: every model.")
    priority: str | None = Field(
        None, description="Class of a request without an x-lmfleet-priority header. Null: the most urgent class.")
    max_priority: str | None = Field(
        None, description="Most urgent class the x-lmfleet-priority header may ask for (more urgent asks are "
        "capped to it). Null: the tenant's `priority`.")
    batch_may_use_providers: bool = Field(
        False, description="Requests of a class with max_wait_s may go to paid providers past their deadline "
        "(else they get 429).")

    @model_validator(mode="after")
    def _one_key_source(self) -> "TenantConfig":
        if (self.api_keys_env is None) == (self.api_keys_file is None):
            given = "both" if self.api_keys_env else "neither"
            raise ValueError(f"tenant {self.name!r}: set exactly one of api_keys_env and api_keys_file ({given} "
                             "given); keys are never written in the fleet file")
        dupes = sorted({m for m in self.models if self.models.count(m) > 1})
        if dupes:
            raise ValueError(f"tenant {self.name!r}: models repeated: {dupes}")
        return self


class TenantSettings(Strict):
    """What may change of a tenant at run time (``PUT /admin/tenants/NAME``): everything but its name and keys.
    Stored as JSON in the spend store's database (``tenant_overrides``); resolved like :class:`TenantConfig`."""

    limits: TenantLimits = Field(default_factory=TenantLimits, description="Rate, concurrency and spend limits.")
    models: list[str] = Field(default_factory=list, description="Models the tenant may use. Empty: every model.")
    priority: str | None = Field(None, description="Class of a request without an x-lmfleet-priority header.")
    max_priority: str | None = Field(None, description="Most urgent class the x-lmfleet-priority header may ask for.")
    batch_may_use_providers: bool = Field(False, description="Batch past its deadline may go to paid providers.")

    @field_validator("models")
    @classmethod
    def _unique_models(cls, models: list[str]) -> list[str]:
        dupes = sorted({m for m in models if models.count(m) > 1})
        if dupes:
            raise ValueError(f"models repeated: {dupes}")
        return models

    def as_config(self, name: str) -> TenantConfig:
        """These settings as a :class:`TenantConfig` without keys (a placeholder key source), for the checks and
        :meth:`lmfleet.tenants.Tenant.from_config`."""
        return TenantConfig(name=name, api_keys_env="LMFLEET_NO_KEYS", **self.model_dump())


class TenantUpdate(Strict):
    """The body of ``PUT /admin/tenants/NAME``: the fields given replace the current ones; ``limits`` merges field by
    field (``{"limits": {"requests_per_minute": null}}`` lifts that limit, the others stay)."""

    limits: TenantLimits | None = Field(None, description="Limits to change (only the fields given).")
    models: list[str] | None = Field(None, description="Models the tenant may use (null or empty: every model).")
    priority: str | None = Field(None, description="Class of a request without a header (null: the most urgent).")
    max_priority: str | None = Field(None, description="Most urgent class the header may ask for (null: priority).")
    batch_may_use_providers: StrictBool | None = Field(None, description="Batch may pay past its deadline.")

    def merged(self, current: TenantSettings) -> TenantSettings:
        """``current`` with this update applied (validated again as a whole: repeated models are refused)."""
        data = current.model_dump()
        for key in self.model_fields_set:
            value = getattr(self, key)
            if key == "limits" and value is not None:
                data["limits"] = {**data["limits"], **value.model_dump(include=value.model_fields_set)}
            elif key == "models":
                data["models"] = value or []
            elif key == "batch_may_use_providers":
                data[key] = bool(value) if value is not None else data[key]
            else:
                data[key] = value
        return TenantSettings.model_validate(data)


# ---- checks across the file ---------------------------------------------------------------------------------

class FleetLike(Protocol):
    """What :func:`check_tenants` reads: ``FleetConfig`` once it has the two keys."""

    tenants: Sequence[TenantConfig]
    priority_classes: Sequence[PriorityClass]
    models: Sequence[Any]  # objects with .name
    gateway: Any  # object with .api_keys_env, .api_keys_file


@dataclass(frozen=True)
class TenantProblem:
    """One cross-reference error: its key path (as the loader's ``loc``), what is wrong, the value found."""

    loc: tuple[str | int, ...]
    message: str
    value: str

    @property
    def path(self) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(self.loc))

    def __str__(self) -> str:
        return f"{self.path}: {self.message} (got {self.value!r})"


def _hint(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def check_tenants(fleet: FleetLike) -> list[TenantProblem]:
    """Every reference across the file that does not hold, in file order (empty: all good).

    Duplicate tenant names, the reserved ``default`` name while flat gateway keys exist, two tenants
    reading the same key source, unknown models, priorities that are not classes, and a default
    priority more urgent than the tenant's ``max_priority``.
    """
    problems: list[TenantProblem] = []
    served = [m.name for m in fleet.models]
    order = {c.name: c.order for c in fleet.priority_classes}
    classes = list(order)
    urgent = min(order, key=order.__getitem__, default="")
    seen: dict[str, int] = {}
    sources: dict[tuple[str, str], str] = {}
    flat = getattr(fleet.gateway, "api_keys_env", None) or getattr(fleet.gateway, "api_keys_file", None)
    for i, t in enumerate(fleet.tenants):
        at = ("tenants", i)
        if t.name in seen:
            problems.append(TenantProblem(at + ("name",), f"tenant names must be unique; this one is already "
                                          f"tenants[{seen[t.name]}]", t.name))
        seen.setdefault(t.name, i)
        if t.name == DEFAULT_TENANT and flat:
            problems.append(TenantProblem(at + ("name",), f"{DEFAULT_TENANT!r} is the tenant of the gateway.api_keys_* "
                                          "keys; rename this tenant or move those keys here", t.name))
        src = ("api_keys_env", t.api_keys_env) if t.api_keys_env else ("api_keys_file", t.api_keys_file or "")
        if src in sources:
            problems.append(TenantProblem(at + (src[0],), f"also the key source of tenant {sources[src]!r}; a key "
                                          "must belong to one tenant", src[1]))
        sources.setdefault(src, t.name)
        for j, m in enumerate(t.models):
            if m not in served:
                problems.append(TenantProblem(at + ("models", j), f"unknown model; {_hint(m, served)}"
                                              f"served: {served}", m))
        for key in ("priority", "max_priority"):
            value = getattr(t, key)
            if value is not None and value not in order:
                problems.append(TenantProblem(at + (key,), f"unknown priority class; {_hint(value, classes)}"
                                              f"classes: {classes}", value))
        priority = t.priority if t.priority is not None else urgent  # null: the most urgent class
        if priority in order and t.max_priority in order and order[priority] < order[t.max_priority]:
            what = "more urgent" if t.priority is not None else f"null (the most urgent class, {urgent!r}), more urgent"
            problems.append(TenantProblem(at + ("priority",), f"{what} than max_priority {t.max_priority!r}; "
                                          "lower priority or raise max_priority", priority))
    return problems


def tenant_validation_error(problems: Sequence[TenantProblem], title: str = "FleetConfig") -> ValidationError:
    """``problems`` as one pydantic ``ValidationError`` with a ``loc`` per problem: raised from
    ``FleetConfig``'s model validator, the loader reports each with its line and key path."""
    return ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError("tenant_reference", "{message}", {"message": p.message}),
                         loc=p.loc, input=p.value)
        for p in problems])


def check_settings(name: str, settings: TenantSettings, *, served: Sequence[str],
                   classes: Sequence[PriorityClass]) -> list[TenantProblem]:
    """:func:`check_tenants`'s checks of one tenant's run-time settings (unknown models and classes, a priority
    more urgent than ``max_priority``), with key paths relative to the settings (``models[0]``, ``priority``)."""
    from types import SimpleNamespace

    fleet = SimpleNamespace(tenants=[settings.as_config(name)], priority_classes=list(classes),
                            models=[SimpleNamespace(name=m) for m in served],
                            gateway=SimpleNamespace(api_keys_env=None, api_keys_file=None))
    return [TenantProblem(p.loc[2:], p.message, p.value) for p in check_tenants(fleet)]
