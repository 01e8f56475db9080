"""Key rotation without a restart: key files are re-read when they change, or on ``POST /admin/keys/reload``.

    files = KeyFiles(directory)          # the key sources TenantDirectory.build kept
    await files.poll_forever()           # in the gateway's lifespan, in every gateway process: a stat per file
                                         # every period_s, a read only when its size, mtime or inode changed
    report = await files.reload()        # POST /admin/keys/reload: read every key file now

A changed file's keys replace that tenant's file keys in the :class:`TenantDirectory` (one step on the event loop):
a new key works and a removed one stops working within ``period_s``; requests already admitted are not touched.

Fail safe, never open: a file that is missing, unreadable or holds no key keeps the tenant's keys in force, and
one warning says so (repeated only when the problem changes); a file whose new keys include a key of another
tenant is refused the same way (:func:`merge_keys`). Messages name the config key and the file, never a key.
Keys from ``api_keys_env`` cannot change in a running process (a process's environment is fixed when it starts):
rotating them needs ``api_keys_file``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmfleet.tenants.directory import KeySource, TenantDirectory, TenantKeyError, digest, read_key_file

__all__ = ["FileRead", "KeyFiles", "ReloadReport", "merge_keys"]

log = logging.getLogger("lmfleet.tenants")

POLL_S = 2.0
"""How often each gateway process looks at its key files (a ``stat`` each)."""

Signature = tuple[int, int, int, int]
"""(device, inode, size, mtime in ns): a change in any of them means the file may hold other keys."""


def _signature(st: os.stat_result) -> Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def merge_keys(current: Mapping[str, frozenset[bytes]],
               fresh: Mapping[str, frozenset[bytes]]) -> tuple[dict[str, frozenset[bytes]], dict[str, str]]:
    """The keys to put in force (tenant -> digests) when the tenants in ``fresh`` re-read their sources, and the
    tenants refused (tenant -> the tenant that holds one of its new keys). Pure.

    ``current``: every tenant's digests in force (no key held by two tenants). A key may identify one tenant only:
    when a fresh set shares a key with another tenant's, the fresh one is refused and keeps its current keys (both,
    when both are fresh: moving a key between two files takes two steps, remove then add). Refusing only ever goes
    back to ``current``, so the result never holds a key twice.
    """
    new = {**current, **fresh}
    refused: dict[str, str] = {}
    while True:
        owner: dict[bytes, str] = {}
        clash: tuple[str, str] | None = None
        for name, ds in new.items():
            for d in ds:
                other = owner.setdefault(d, name)
                if other != name:
                    clash = (other, name)
                    break
            if clash is not None:
                break
        if clash is None:
            return new, refused
        reverted = False
        for t, o in (clash, clash[::-1]):
            if t in fresh and t not in refused:
                refused[t] = o
                new[t] = current.get(t, frozenset())
                reverted = True
        if not reverted:  # cannot happen while ``current`` holds no key twice
            raise ValueError(f"tenants {clash[0]!r} and {clash[1]!r} hold the same API key in the current keys")


@dataclass(frozen=True)
class FileRead:
    """One key file as read now: its digests, or why it cannot be used (``error``, no key in it)."""

    source: KeySource
    signature: Signature | None
    digests: frozenset[bytes] | None = field(default=None, repr=False)
    error: str | None = None
    transient: bool = False
    """The file changed while it was read: not a problem to warn about, it is read again at the next look."""


@dataclass
class ReloadReport:
    """What a re-read did: each tenant's key count now, the tenants whose keys changed, the problems."""

    keys: dict[str, int]
    reloadable: dict[str, bool]
    """Per tenant: its keys come from a file (True), or from a variable or nowhere (False: fixed until a restart)."""
    changed: list[str] = field(default_factory=list)
    errors: list[dict[str, str]] = field(default_factory=list)
    """``{"tenant", "param", "message"}`` per source whose keys could not be used (its keys in force stay)."""

    def body(self) -> dict[str, Any]:
        return {"tenants": {n: {"keys": k, "reloadable": self.reloadable[n]} for n, k in self.keys.items()},
                "changed": self.changed, "errors": self.errors}


class KeyFiles:
    """The key files of a :class:`TenantDirectory`, watched for changes (see the module docstring)."""

    def __init__(self, directory: TenantDirectory, *, period_s: float = POLL_S):
        self.directory = directory
        self.period_s = period_s
        self.sources = tuple(s for s in directory.sources if s.file)
        self._seen: dict[str, Signature | None] = {}
        """Per tenant: the signature of the file content in force (absent: not read since start, so read it)."""
        self._failing: dict[str, str] = {}
        """Per tenant whose file cannot be used now: the warning logged (logged again only when it changes)."""
        self._lock = asyncio.Lock()

    # ---- reading (blocking: in a thread) ---------------------------------------------------------------------
    def scan(self, force: bool = False) -> list[FileRead]:
        """Stat every key file; read those that changed (all of them with ``force``), or that failed last time."""
        out = []
        for src in self.sources:
            assert src.file is not None
            param = f"{src.where}.api_keys_file"
            try:
                before = _signature(os.stat(src.file))
            except OSError as e:
                out.append(FileRead(src, None, error=f"{param} {src.file!r} cannot be read: {e.strerror or e}"))
                continue
            if not force and src.tenant in self._seen and self._seen[src.tenant] == before \
                    and src.tenant not in self._failing:
                continue
            try:
                digests = frozenset(digest(k) for k in read_key_file(src.where, src.file))
                after = _signature(os.stat(src.file))
            except TenantKeyError as e:
                out.append(FileRead(src, before, error=str(e)))
                continue
            except OSError as e:
                out.append(FileRead(src, None, error=f"{param} {src.file!r} cannot be read: {e.strerror or e}"))
                continue
            if after != before:  # written to while being read: what was read may be half of it
                out.append(FileRead(src, None, error=f"{param} {src.file!r} changed while it was read; try again "
                                                     "(replace key files atomically: write a new file, then rename "
                                                     "it over the old one)", transient=True))
                continue
            out.append(FileRead(src, before, digests | src.env_digests))
        return out

    # ---- applying (on the event loop) -------------------------------------------------------------------------
    def apply(self, reads: list[FileRead]) -> ReloadReport:
        """Put the keys of the files read in force (:func:`merge_keys`), log what changed and what failed."""
        current = self.directory.digests_by_tenant()
        fresh = {r.source.tenant: r.digests for r in reads if r.digests is not None}
        new, refused = merge_keys(current, fresh)
        errors: list[tuple[KeySource, str, bool]] = [(r.source, r.error, r.transient) for r in reads
                                                     if r.error is not None]
        by_tenant = {r.source.tenant: r for r in reads}
        where = {s.tenant: s.where for s in self.directory.sources}
        for t, other in refused.items():
            src = by_tenant[t].source
            errors.append((src, f"{src.where}.api_keys_file {src.file!r} holds a key that tenant {other!r} "
                                f"({where.get(other, '?')}) holds; a key must identify one tenant", False))
        changed = [t for t in fresh if t not in refused and new[t] != current.get(t, frozenset())]
        if changed:
            self.directory.set_keys(new)
        report = ReloadReport(self.directory.key_counts(), {t: False for t in self.directory.tenants})
        for s in self.sources:
            report.reloadable[s.tenant] = True
        for t in changed:
            old, now = current.get(t, frozenset()), new[t]
            src = by_tenant[t].source
            log.info("keys: tenant %r now holds %d key(s) (%d added, %d removed), re-read from %s.api_keys_file %r",
                     t, len(now), len(now - old), len(old - now), src.where, src.file)
        report.changed = changed
        failed = {src.tenant for src, _, _ in errors}
        for src, message, transient in errors:
            kept = len(current.get(src.tenant, frozenset()))
            text = f"{message}; tenant {src.tenant!r} keeps the {kept} key(s) it holds"
            report.errors.append({"tenant": src.tenant, "param": f"{src.where}.api_keys_file", "message": text})
            if transient:
                continue
            if self._failing.get(src.tenant) != message:
                log.warning("keys: %s", text)
            self._failing[src.tenant] = message
        for r in reads:
            t = r.source.tenant
            if t in failed:
                continue
            self._seen[t] = r.signature
            if self._failing.pop(t, None) is not None and t not in changed:
                log.info("keys: %s.api_keys_file %r can be used again; tenant %r keeps its %d key(s)",
                         r.source.where, r.source.file, t, len(new[t]))
        return report

    async def check(self, force: bool = False) -> ReloadReport:
        """Read what changed (everything with ``force``) in a thread and put it in force here."""
        async with self._lock:
            reads = await asyncio.to_thread(self.scan, force) if self.sources else []
            return self.apply(reads)

    async def reload(self) -> ReloadReport:
        """Re-read every key file now (``POST /admin/keys/reload``)."""
        return await self.check(force=True)

    async def poll_forever(self, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        """Every ``period_s``: put changed key files in force (cancel to stop). Never ends on an error."""
        while True:
            await sleep(self.period_s)
            try:
                await self.check()
            except Exception:  # a bug here must not stop rotation for the life of the process
                log.exception("keys: checking the key files failed; trying again in %.0f s", self.period_s)
