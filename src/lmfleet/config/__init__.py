"""Fleet configuration: pydantic models and the YAML loader."""

from lmfleet.config.loader import ConfigError, default_config_text, load_config, parse_config
from lmfleet.config.models import (
    AutoscalingConfig,
    BudgetConfig,
    ClusterConfig,
    DeploymentConfig,
    EngineConfig,
    FleetConfig,
    GatewayConfig,
    ModelConfig,
    ProviderConfig,
)

__all__ = [
    "AutoscalingConfig",
    "BudgetConfig",
    "ClusterConfig",
    "ConfigError",
    "DeploymentConfig",
    "EngineConfig",
    "FleetConfig",
    "GatewayConfig",
    "ModelConfig",
    "ProviderConfig",
    "default_config_text",
    "load_config",
    "parse_config",
]
