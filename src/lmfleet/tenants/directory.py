"""Who is calling: API key -> :class:`Tenant`, with the keys held only as SHA-256 digests.

    directory = TenantDirectory.build(fleet.tenants, fleet.priority_classes, gateway=fleet.gateway,
                                      environ=os.environ)
    tenant = directory.resolve(bearer_token)      # None: no such key (401)

The flat ``gateway.api_keys_env``/``api_keys_file`` keys become the tenant ``default`` (no limits, every
model, the most urgent class), so a fleet without ``tenants:`` behaves as before. With no key anywhere
the gateway is open (``is_open``) and every request is the default tenant's.

Keys are hashed once at start; a lookup hashes the presented key and looks the digest up in a dict.
Timing can reveal at most something about a digest, never about a key (the same argument as comparing
with ``hmac.compare_digest``). No key, digest or key-file line appears in a repr or an error message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmfleet.config.tenants import DEFAULT_TENANT, PriorityClass, TenantConfig, TenantLimits

__all__ = ["Tenant", "TenantDirectory", "TenantKeyError", "digest", "load_keys"]


class TenantKeyError(ValueError):
    """A key source that cannot be used (unset, unreadable, empty) or a key held by two tenants.

    The message names the config key and the env var or file, never a key.
    """


@dataclass(frozen=True)
class Tenant:
    """A tenant as the gateway uses it: classes resolved to objects, models as a set (empty: all)."""

    name: str
    limits: TenantLimits
    priority: PriorityClass
    """The class of a request that names none."""
    max_priority: PriorityClass
    """The most urgent class a request may ask for."""
    models: frozenset[str] = frozenset()
    batch_may_use_providers: bool = False

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models

    @classmethod
    def from_config(cls, cfg: TenantConfig, classes: Sequence[PriorityClass]) -> "Tenant":
        """Resolve ``cfg`` against ``classes`` (``check_tenants`` reports bad names with their key path first;
        this raises ValueError for a caller that skipped it)."""
        by_name = {c.name: c for c in classes}
        for key in ("priority", "max_priority"):
            if getattr(cfg, key) not in (None, *by_name):
                raise ValueError(f"tenant {cfg.name!r}: {key} {getattr(cfg, key)!r} is not a priority class "
                                 f"{sorted(by_name)}")
        urgent = min(classes, key=lambda c: c.order)
        priority = by_name[cfg.priority] if cfg.priority is not None else urgent
        top = by_name[cfg.max_priority] if cfg.max_priority is not None else priority
        return cls(cfg.name, cfg.limits, priority, top, frozenset(cfg.models), cfg.batch_may_use_providers)

    @classmethod
    def default(cls, classes: Sequence[PriorityClass]) -> "Tenant":
        """The tenant of the flat gateway keys: no limits, every model, the most urgent class."""
        urgent = min(classes, key=lambda c: c.order)
        return cls(DEFAULT_TENANT, TenantLimits(), urgent, urgent)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def load_keys(where: str, env_name: str | None, file: str | None, environ: Mapping[str, str]) -> set[str]:
    """Keys from an env var (comma-separated) and/or a file (one a line, # comments). ``where`` is the config
    path for messages (``tenants[2]``, ``gateway``). A configured source that yields no key raises
    :class:`TenantKeyError`: a tenant must never lose its keys silently."""
    keys: set[str] = set()
    if env_name:
        from_env = {k.strip() for k in environ.get(env_name, "").split(",") if k.strip()}
        if not from_env:
            raise TenantKeyError(f"{where}.api_keys_env names {env_name}, but that variable is unset or empty. "
                                 f"Export {env_name}=key1,key2 or remove {where}.api_keys_env.")
        keys |= from_env
    if file:
        path = Path(file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise TenantKeyError(f"{where}.api_keys_file {str(path)!r} cannot be read: {e.strerror or e}") from None
        from_file = {ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")}
        if not from_file:
            raise TenantKeyError(f"{where}.api_keys_file {str(path)!r} holds no key (only blank or # lines).")
        keys |= from_file
    return keys


@dataclass(frozen=True)
class TenantDirectory:
    """Every tenant by name and by key digest. Build it with :meth:`build`."""

    tenants: Mapping[str, Tenant]
    """By name, in config order, the default tenant first when it exists."""
    _by_digest: Mapping[bytes, Tenant] = field(repr=False)

    @property
    def is_open(self) -> bool:
        """No key is configured anywhere: every request is the default tenant's."""
        return not self._by_digest

    @property
    def key_count(self) -> int:
        return len(self._by_digest)

    def resolve(self, key: str | None) -> Tenant | None:
        """The tenant holding ``key``; None when no tenant does (answer 401). An open directory answers the
        default tenant for any key or none."""
        if self.is_open:
            return self.tenants[DEFAULT_TENANT]
        if not key:
            return None
        return self._by_digest.get(digest(key))

    def replace(self, tenant: Tenant) -> None:
        """Put ``tenant`` (new settings, same name and keys) in place of the one of that name: every key of the
        tenant resolves to it from now on (run-time changes, :mod:`lmfleet.tenants.admin`). Each dict item is
        swapped in one step, so a lookup on the event loop sees the old tenant or the new one."""
        if tenant.name not in self.tenants:
            raise KeyError(tenant.name)
        by_name: dict[str, Tenant] = self.tenants  # type: ignore[assignment]  # built as dicts in build()
        by_name[tenant.name] = tenant
        by_digest: dict[bytes, Tenant] = self._by_digest  # type: ignore[assignment]
        for d, t in list(by_digest.items()):
            if t.name == tenant.name:
                by_digest[d] = tenant

    @classmethod
    def build(cls, tenants: Sequence[TenantConfig], classes: Sequence[PriorityClass], *, gateway: Any = None,
              environ: Mapping[str, str]) -> "TenantDirectory":
        """Load every tenant's keys from ``environ`` and the key files. ``gateway``: an object with
        ``api_keys_env``/``api_keys_file`` (``GatewayConfig``); its keys become the default tenant.

        Raises :class:`TenantKeyError` when a source yields no key or one key belongs to two tenants.
        """
        by_name: dict[str, Tenant] = {}
        by_digest: dict[bytes, Tenant] = {}
        owner_path: dict[str, str] = {}
        sources: list[tuple[str, Tenant, str | None, str | None]] = []
        flat_env = getattr(gateway, "api_keys_env", None)
        flat_file = getattr(gateway, "api_keys_file", None)
        if flat_env or flat_file or not tenants:
            sources.append(("gateway", Tenant.default(classes), flat_env, flat_file))
        for i, t in enumerate(tenants):
            sources.append((f"tenants[{i}]", Tenant.from_config(t, classes), t.api_keys_env, t.api_keys_file))
        for where, tenant, env_name, file in sources:
            by_name[tenant.name] = tenant
            owner_path[tenant.name] = where
            if not (env_name or file):
                continue
            for key in load_keys(where, env_name, file, environ):
                d = digest(key)
                other = by_digest.get(d)
                if other is not None and other.name != tenant.name:
                    raise TenantKeyError(f"{where} ({tenant.name!r}) and {owner_path[other.name]} ({other.name!r}) "
                                         "hold the same API key; a key must identify one tenant")
                by_digest[d] = tenant
        return cls(by_name, by_digest)
