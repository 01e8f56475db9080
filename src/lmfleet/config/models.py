"""Pydantic models for ``fleet.yaml``: one model per concern, unknown keys rejected.

The whole file is a :class:`FleetConfig`. Each section lives in its own class so the CLI, the JSON schema
(``lmfleet config schema``) and the docs come from one place. The classes live in one module per section; this
module names them all, so ``from lmfleet.config.models import X`` reaches any of them:

    engine.py      EngineConfig (``models[].engine``)
    deployment.py  DeploymentConfig and its parts: autoscaling, request router, prefill/decode pools
    overflow.py    OverflowPolicyConfig (``models[].overflow``)
    model.py       ModelConfig, CostConfig (``models[]``)
    gateway.py     GatewayConfig, ObservabilityConfig
    providers.py   ProviderConfig and its price, timeouts and breaker
    budget.py      BudgetConfig, LedgerConfig
    cluster.py     ClusterConfig, NodeConfig, SshConfig
    tenants.py     TenantConfig, PriorityClass (``tenants``, ``priority_classes``)
    fleet.py       FleetConfig: every section, and the checks across sections
"""

from __future__ import annotations

from lmfleet.config.budget import BudgetConfig, LedgerConfig
from lmfleet.config.cluster import ClusterConfig, NodeConfig, SshConfig
from lmfleet.config.deployment import (
    KV_CONNECTORS,
    AutoscalingConfig,
    DeploymentConfig,
    DisaggregationConfig,
    PoolConfig,
    PrefixAwareConfig,
    RequestRouterName,
)
from lmfleet.config.engine import EngineConfig
from lmfleet.config.fleet import FleetConfig
from lmfleet.config.gateway import GatewayConfig, ObservabilityConfig
from lmfleet.config.model import CostConfig, ModelConfig
from lmfleet.config.overflow import OverflowPolicyConfig
from lmfleet.config.providers import BreakerConfig, ProviderConfig, ProviderPrice, ProviderTimeouts

__all__ = [
    "KV_CONNECTORS",
    "AutoscalingConfig",
    "BreakerConfig",
    "BudgetConfig",
    "ClusterConfig",
    "CostConfig",
    "DeploymentConfig",
    "DisaggregationConfig",
    "EngineConfig",
    "FleetConfig",
    "GatewayConfig",
    "LedgerConfig",
    "ModelConfig",
    "NodeConfig",
    "ObservabilityConfig",
    "OverflowPolicyConfig",
    "PoolConfig",
    "PrefixAwareConfig",
    "ProviderConfig",
    "ProviderPrice",
    "ProviderTimeouts",
    "RequestRouterName",
    "SshConfig",
]
