"""Tenants and priority classes: who is calling, what they may use, and who waits when the fleet is full.

    directory.py   TenantDirectory: API key (held as a SHA-256 digest) -> Tenant; the flat keys -> "default"
    window.py      RateWindow: a sliding-window counter, O(1) per request (requests and tokens per minute)
    admission.py   requested_class() from the x-lmfleet-priority header; admit(): local now / local wait /
                   provider / 429 with OpenAI's rate-limit headers
    book.py        TenantBook: live usage (rate windows, in flight); Ticket per admitted request; with a
                   shared store, admission and counting in one transaction across processes and nodes
    shared.py      SharedLimits: the spend store's database as that shared store; fails open to limit/workers
    fairness.py    next_to_dispatch(): classes strictly, tenants least-recently-served, FIFO within a tenant
    admin.py       TenantAdmin: settings changed at run time (PUT /admin/tenants/NAME): validated, persisted in
                   the spend store's database, applied in every gateway process (each polls for changes)
    keys.py        KeyFiles: key files re-read when they change (rotation without a restart; fail safe: a file
                   that cannot be used keeps the keys in force), POST /admin/keys/reload

All pure but ``shared.py`` and ``admin.py`` (the database, through the spend store), ``keys.py`` (stat and read the
key files) and reading key sources in ``TenantDirectory.build``. The config models are in
``lmfleet.config.tenants``; how the gateway will call these is in docs/tenants.md.
"""

from lmfleet.tenants.admission import (
    PRIORITY_HEADER,
    Admission,
    Outcome,
    PriorityHeaderError,
    Reason,
    TenantUsage,
    admit,
    model_refusal,
    rate_limit_headers,
    requested_class,
)
from lmfleet.tenants.book import TenantBook, Ticket
from lmfleet.tenants.directory import Tenant, TenantDirectory, TenantKeyError
from lmfleet.tenants.fairness import Waiting, expired, next_to_dispatch, served
from lmfleet.tenants.window import RateWindow, format_duration

__all__ = [
    "PRIORITY_HEADER",
    "Admission",
    "Outcome",
    "PriorityHeaderError",
    "RateWindow",
    "Reason",
    "Tenant",
    "TenantDirectory",
    "TenantKeyError",
    "TenantBook",
    "TenantUsage",
    "Ticket",
    "Waiting",
    "admit",
    "expired",
    "format_duration",
    "model_refusal",
    "next_to_dispatch",
    "rate_limit_headers",
    "requested_class",
    "served",
]
