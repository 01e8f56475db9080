"""Admin routes of tenants and their keys (admin key).

    GET    /admin/tenants                every tenant's settings and live usage
    PUT    /admin/tenants/{name}         change a tenant's limits, models or classes (every process, kept)
    DELETE /admin/tenants/{name}         back to its fleet.yaml settings
    POST   /admin/keys/reload            re-read every key file now

:class:`~lmfleet.tenants.admin.TenantAdmin` keeps the settings, :class:`~lmfleet.tenants.keys.KeyFiles` reads the
key files.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from lmfleet.config.models import GatewayConfig
from lmfleet.gateway.front.access import read_json
from lmfleet.gateway.front.errors import GatewayError, error_body
from lmfleet.gateway.service import Gateway
from lmfleet.store import Ledger, SqliteSpendStore, StoreUnavailable
from lmfleet.tenants import TenantBook, TenantDirectory
from lmfleet.tenants.admin import TenantAdmin, TenantSettingsError
from lmfleet.tenants.keys import KeyFiles

log = logging.getLogger("lmfleet.gateway")


def tenant_routes(gw: Gateway, cfg: GatewayConfig, tenant_admin: TenantAdmin | None, key_files: KeyFiles) -> APIRouter:
    """The tenant and key routes above, for one gateway process."""
    r = APIRouter()

    @r.get("/admin/tenants")
    async def admin_tenants() -> dict[str, Any]:
        """Every tenant's settings and this process's live usage (admin key; no key or digest is shown)."""
        book = gw.router.tenants
        queues = {n: {"capacity": m.queue.capacity, "running": m.queue.running, "waiting": len(m.queue.waiting),
                      "peer_running": m.queue.peer_running, "share": m.queue.share}
                  for n, m in gw.models.items() if m.queue is not None}
        return {"classes": [c.model_dump() for c in book.classes] if book is not None else [],
                "tenants": tenant_report(gw.tenants, book, tenant_admin), "local_queues": queues}

    @r.put("/admin/tenants/{name}")
    async def admin_put_tenant(name: str, request: Request) -> dict[str, Any]:
        """Change a tenant's limits, models or classes now, in every gateway process, kept across restarts: the
        fields given replace the current ones (``limits`` field by field). The tenant's effective settings."""
        body = await read_json(request, cfg.max_body_bytes, cfg.body_timeout_s)
        admin = _admin_of(tenant_admin, name)
        try:
            settings = await admin.update(name, body)
        except TenantSettingsError as e:
            raise GatewayError(400, e.message, param=e.param, code="invalid_tenant_settings") from None
        except StoreUnavailable as e:
            raise GatewayError(503, f"The tenant settings cannot be saved now (nothing changed): {e}") from None
        log.info("admin: tenant %s settings set to %s", name, settings.model_dump_json())
        return {"tenant": name, "persisted": admin.store is not None,
                **tenant_report(gw.tenants, gw.router.tenants, admin)[name]}

    @r.delete("/admin/tenants/{name}")
    async def admin_revert_tenant(name: str) -> dict[str, Any]:
        """Back to the tenant's settings in fleet.yaml (in every gateway process)."""
        admin = _admin_of(tenant_admin, name)
        try:
            await admin.revert(name)
        except StoreUnavailable as e:
            raise GatewayError(503, f"The tenant settings cannot be saved now (nothing changed): {e}") from None
        log.info("admin: tenant %s back to its fleet.yaml settings", name)
        return {"tenant": name, **tenant_report(gw.tenants, gw.router.tenants, admin)[name]}

    @r.post("/admin/keys/reload")
    async def admin_reload_keys() -> JSONResponse:
        """Re-read every key file now (this process; the others see a changed file within their poll period).
        Each tenant's key count (never a key); 422 when a file could not be used (its tenant keeps its keys)."""
        report = await key_files.reload()
        body = report.body()
        log.info("admin: key files re-read: %s", {n: t["keys"] for n, t in body["tenants"].items()})
        if report.errors:
            first = report.errors[0]
            body.update(error_body(f"{len(report.errors)} key file(s) could not be used; their tenants keep the keys "
                                   f"they hold. First: {first['message']}", param=first["param"],
                                   code="key_file_unusable"))
            return JSONResponse(body, status_code=422)
        return JSONResponse(body)

    return r


def tenant_admin_for(gw: Gateway) -> TenantAdmin | None:
    """Run-time tenant settings (None without ``tenants:``), persisted in the spend store's database: the one the
    gateway opened, else one opened on the SQLite ledger's file (closed with the ledger). A PostgreSQL ledger without
    a spend store keeps changes in memory only (``persisted: false``)."""
    book = gw.router.tenants
    if book is None or not any(m.queue is not None for m in gw.models.values()):
        return None
    store = gw.recorder.store
    if store is None and isinstance(gw.recorder.ledger, Ledger):
        try:
            store = gw.recorder.store = SqliteSpendStore(gw.recorder.ledger.path)
        except StoreUnavailable as e:
            log.error("tenant settings: cannot open the ledger's database (%s); admin changes stay in memory", e)
    if store is None:
        log.warning("tenant settings: no spend store in this gateway; PUT /admin/tenants changes are kept in "
                    "memory only (lost at restart, not shared across processes)")
    admin = TenantAdmin(gw.tenants, book, gw.router.tenant_caps, served=list(gw.models), store=store,
                        spend_caps=gw.router.guard is not None)
    admin.load()
    return admin


def _admin_of(admin: TenantAdmin | None, name: str) -> TenantAdmin:
    """``admin`` when ``name`` is one of its tenants, else a 404 (the name is echoed only when it is a valid one)."""
    if admin is None:
        raise GatewayError(404, "No tenants are configured (fleet.yaml `tenants:`).", param="name",
                           code="tenant_not_found")
    if name not in admin.directory.tenants:
        shown = repr(name) if len(name) <= 63 and name.replace("-", "").replace("_", "").isalnum() else "that name"
        raise GatewayError(404, f"No tenant named {shown}; tenants: {sorted(admin.directory.tenants)}.",
                           param="name", code="tenant_not_found")
    return admin


def tenant_report(directory: TenantDirectory, book: TenantBook | None,
                  admin: TenantAdmin | None = None) -> dict[str, Any]:
    """``GET /admin/tenants``: per tenant its limits, models, classes and, per gateway process, what it uses."""
    out: dict[str, Any] = {}
    now = book.clock() if book is not None else time.time()
    for name, t in directory.tenants.items():
        usage = book.usage.get(name) if book is not None else None
        windows = {}
        for kind, w in (("requests_per_minute", usage.requests if usage else None),
                        ("tokens_per_minute", usage.tokens if usage else None)):
            if w is not None:
                windows[kind] = {"limit": w.limit, "used": round(w.used(now), 1), "remaining": w.remaining(now)}
        out[name] = {"limits": t.limits.model_dump(), "models": sorted(t.models) or None,
                     "priority": t.priority.name, "max_priority": t.max_priority.name,
                     "batch_may_use_providers": t.batch_may_use_providers,
                     "in_flight": book.in_flight.get(name, 0) if book is not None else None, "windows": windows,
                     **(admin.source(name) if admin is not None else {"source": "fleet.yaml"})}
    return out
