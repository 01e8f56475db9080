"""Who served a request, as one label: ``local/MODEL`` (the fleet's own engines) or ``provider/NAME``
(an external provider).

The label is what the gateway sends in ``x-lmfleet-served-by``, what the ledger groups by, what the
metrics carry as ``served_by`` and what ``lmfleet bench`` reports per provider. It is built and read
only here; everything else carries it as an opaque string.
"""

from __future__ import annotations

__all__ = ["LOCAL_PREFIX", "PROVIDER_PREFIX", "is_external", "local_label", "provider_label"]

LOCAL_PREFIX = "local/"
PROVIDER_PREFIX = "provider/"


def local_label(model: str) -> str:
    """``local/MODEL``: served by the fleet's own engines for ``model``."""
    return f"{LOCAL_PREFIX}{model}"


def provider_label(name: str) -> str:
    """``provider/NAME``: served by the external provider ``name``."""
    return f"{PROVIDER_PREFIX}{name}"


def is_external(label: str) -> bool:
    """Served by an external provider (costs money outside the fleet)."""
    return label.startswith(PROVIDER_PREFIX)
