"""What every section of ``fleet.yaml`` shares: unknown keys are rejected and defaults are validated too."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)
