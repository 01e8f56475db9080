"""Who is calling: API key -> :class:`Tenant`, with the keys held only as SHA-256 digests.

    directory = TenantDirectory.build(fleet.tenants, fleet.priority_classes, gateway=fleet.gateway,
                                      environ=os.environ)
    tenant = directory.resolve(bearer_token)      # None: no such key (401)

The flat ``gateway.api_keys_env``/``api_keys_file`` keys become the tenant ``default`` (no limits, every
model, the most urgent class), so a fleet without ``tenants:`` behaves as before. With no key anywhere
the gateway is open (``is_open``) and every request is the default tenant's.

Keys are hashed when they are loaded; a lookup hashes the presented key and looks the digest up in a dict.
Timing can reveal at most something about a digest, never about a key (the same argument as comparing
with ``hmac.compare_digest``). No key, digest or key-file line appears in a repr or an error message.

Each tenant's key source is kept (:class:`KeySource`: the variable and file names, the variable's keys as
digests), so that :class:`lmfleet.tenants.keys.KeyFiles` can re-read the key files while the gateway runs and
put the new keys in force with :meth:`TenantDirectory.set_keys`. Keys from environment variables cannot change in
a running process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmfleet.errors import LmfleetError
from lmfleet.config.tenants import DEFAULT_TENANT, PriorityClass, TenantConfig, TenantLimits

__all__ = ["KeySource", "Tenant", "TenantDirectory", "TenantKeyError", "digest", "read_key_file"]


class TenantKeyError(LmfleetError, ValueError):
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


def _env_keys(where: str, env_name: str, environ: Mapping[str, str]) -> set[str]:
    from_env = {k.strip() for k in environ.get(env_name, "").split(",") if k.strip()}
    if not from_env:
        raise TenantKeyError(f"{where}.api_keys_env names {env_name}, but that variable is unset or empty. "
                             f"Export {env_name}=key1,key2 or remove {where}.api_keys_env.")
    return from_env


def read_key_file(where: str, file: str) -> set[str]:
    """The keys of a key file (one a line, # comments). Raises :class:`TenantKeyError` when it cannot be read or
    holds no key; the message names ``where`` (``tenants[2]``, ``gateway``) and the file, never a line of it."""
    path = Path(file).expanduser()
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise TenantKeyError(f"{where}.api_keys_file {str(path)!r} cannot be read: {why}") from None
    from_file = {ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")}
    if not from_file:
        raise TenantKeyError(f"{where}.api_keys_file {str(path)!r} holds no key (only blank or # lines).")
    return from_file


@dataclass(frozen=True)
class KeySource:
    """Where one tenant's keys come from (``where``: its config path, ``tenants[2]`` or ``gateway``)."""

    where: str
    tenant: str
    env_name: str | None
    file: str | None
    """The key file, ``~`` expanded; None: keys from the variable only (they cannot change while running)."""
    env_digests: frozenset[bytes] = field(default=frozenset(), repr=False)
    """The variable's keys, hashed: kept beside the file's whenever the file is re-read."""


@dataclass(frozen=True)
class TenantDirectory:
    """Every tenant by name and by key digest. Build it with :meth:`build`."""

    tenants: Mapping[str, Tenant]
    """By name, in config order, the default tenant first when it exists."""
    _by_digest: Mapping[bytes, Tenant] = field(repr=False)
    sources: tuple[KeySource, ...] = field(default=(), repr=False)
    """Each tenant's key source (those with keys), for re-reading key files (:mod:`lmfleet.tenants.keys`)."""

    @property
    def is_open(self) -> bool:
        """No key is configured anywhere: every request is the default tenant's."""
        return not self._by_digest

    @property
    def key_count(self) -> int:
        return len(self._by_digest)

    def key_counts(self) -> dict[str, int]:
        """How many keys each tenant holds now (every tenant, 0 for one without keys); counts only."""
        counts = dict.fromkeys(self.tenants, 0)
        for t in self._by_digest.values():
            counts[t.name] = counts.get(t.name, 0) + 1
        return counts

    def digests_by_tenant(self) -> dict[str, frozenset[bytes]]:
        """Each tenant's key digests in force now (tenants without keys are absent)."""
        out: dict[str, set[bytes]] = {}
        for d, t in self._by_digest.items():
            out.setdefault(t.name, set()).add(d)
        return {name: frozenset(ds) for name, ds in out.items()}

    def set_keys(self, digests: Mapping[str, frozenset[bytes]]) -> None:
        """Put these digests (tenant name -> its keys' digests: every tenant with keys) in force: a key not in
        them stops resolving, a new one resolves to its tenant from now on (key rotation, :mod:`lmfleet.tenants.
        keys`). New keys are added before old ones are removed, so a lookup never finds the directory empty (an
        empty one would be open). Requests that resolved their tenant already keep it.

        Raises ValueError, changing nothing, for an unknown tenant, a key held by two tenants, or no key at all
        in a directory that has keys (that would open every /v1 route)."""
        new: dict[bytes, Tenant] = {}
        for name, ds in digests.items():
            tenant = self.tenants.get(name)
            if tenant is None:
                raise ValueError(f"no tenant {name!r} in this directory")
            for d in ds:
                other = new.setdefault(d, tenant)
                if other.name != name:
                    raise ValueError(f"tenants {other.name!r} and {name!r} would hold the same API key")
        if not new and self._by_digest:
            raise ValueError("refusing to remove every key: the gateway would be open to anyone")
        by_digest: dict[bytes, Tenant] = self._by_digest  # type: ignore[assignment]  # built as a dict in build()
        by_digest.update(new)
        for d in [d for d in by_digest if d not in new]:
            del by_digest[d]

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
        key_sources: list[KeySource] = []
        for where, tenant, env_name, file in sources:
            by_name[tenant.name] = tenant
            owner_path[tenant.name] = where
            if not (env_name or file):
                continue
            env_digests = frozenset(digest(k) for k in _env_keys(where, env_name, environ)) if env_name else frozenset()
            file_digests = frozenset(digest(k) for k in read_key_file(where, file)) if file else frozenset()
            for d in env_digests | file_digests:
                other = by_digest.get(d)
                if other is not None and other.name != tenant.name:
                    raise TenantKeyError(f"{where} ({tenant.name!r}) and {owner_path[other.name]} ({other.name!r}) "
                                         "hold the same API key; a key must identify one tenant")
                by_digest[d] = tenant
            key_sources.append(KeySource(where, tenant.name, env_name,
                                         str(Path(file).expanduser()) if file else None, env_digests))
        return cls(by_name, by_digest, tuple(key_sources))
