"""The whole ``fleet.yaml``: every section, and the checks that need more than one of them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmfleet.config.base import Strict
from lmfleet.config.budget import BudgetConfig, LedgerConfig
from lmfleet.config.cluster import ClusterConfig
from lmfleet.config.gateway import GatewayConfig, ObservabilityConfig
from lmfleet.config.model import ModelConfig
from lmfleet.config.providers import ProviderConfig
from lmfleet.config.routing import routing_problems, routing_validation_error
from lmfleet.config.tenants import (
    PriorityClassList,
    TenantConfig,
    check_tenants,
    default_priority_classes,
    tenant_validation_error,
)

class FleetConfig(Strict):
    """A whole fleet: cluster, gateway, models, overflow providers, budget."""

    version: Literal[1] = Field(1, description="Config format version.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    models: list[ModelConfig] = Field(..., min_length=1, description="Models to serve.")
    providers: list[ProviderConfig] = Field(default_factory=list, description="External providers, in priority order.")
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="Tenants: API keys, limits, allowed models, priority classes. Empty: "
        "one tenant 'default' holding gateway.api_keys_env/api_keys_file (docs/tenants.md).")
    priority_classes: PriorityClassList = Field(
        default_factory=default_priority_classes, description="Priority classes, most urgent first by `order` "
        "(default: interactive, then batch with a 600 s local wait).")

    @model_validator(mode="after")
    def _tenant_refs(self) -> "FleetConfig":
        problems = check_tenants(self)
        if problems:
            raise tenant_validation_error(problems)
        return self

    @model_validator(mode="after")
    def _routing_refs(self) -> "FleetConfig":
        problems = routing_problems(self)
        if problems:
            raise routing_validation_error(problems)
        return self

    @model_validator(mode="after")
    def _cross_refs(self) -> "FleetConfig":
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        pnames = [p.name for p in self.providers]
        pdupes = sorted({n for n in pnames if pnames.count(n) > 1})
        if pdupes:
            raise ValueError(f"provider names must be unique; repeated: {pdupes}")
        for m in self.models:
            for p in m.overflow.providers or []:
                if p not in pnames:
                    raise ValueError(f"model {m.name!r}: overflow provider {p!r} is not in providers {pnames}")
            if m.overflow.policy != "predictive" and not any(
                    m.name in p.model_map for p in self.providers
                    if m.overflow.providers is None or p.name in m.overflow.providers):
                raise ValueError(f"model {m.name!r}: overflow.policy {m.overflow.policy} sends requests to a provider, "
                                 "but no provider's model_map names this model (within overflow.providers); add one, "
                                 "or use policy predictive")
        for p in self.providers:
            unknown = sorted(set(p.model_map) - set(names))
            if unknown:
                raise ValueError(f"provider {p.name!r}: model_map names unknown local models {unknown}; served: {names}")
        return self

    @model_validator(mode="after")
    def _parallel_fits_cluster(self) -> "FleetConfig":
        """One replica's DP x TP x PP GPUs must exist in the cluster the file describes (when it describes one)."""
        c = self.cluster
        nodes = [n for n in [c.head, *c.workers] if n is not None]
        total = sum(c.node_gpus(n) for n in nodes)
        if not nodes or total == 0:
            return self
        for i, m in enumerate(self.models):
            if m.engine.device == "cpu":
                continue
            for role, pm in m.pool_models():
                e = pm.engine
                need = e.data_parallel_size * e.tensor_parallel_size * e.pipeline_parallel_size
                if need > total:
                    where = f"deployment.disaggregation.{role}.engine" if role else "engine"
                    raise ValueError(
                        f"models[{i}] ({m.name}): {where}.data_parallel_size={e.data_parallel_size} x "
                        f"tensor_parallel_size={e.tensor_parallel_size} x pipeline_parallel_size="
                        f"{e.pipeline_parallel_size} = {need} GPUs for one replica, but the cluster section describes "
                        f"{total} GPUs on {len(nodes)} node(s); lower one of them or add nodes")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)
