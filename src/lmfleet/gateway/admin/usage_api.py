"""The admin route that reads the ledger (admin key).

    GET    /admin/usage                  requests, tokens and cost per backend or per tenant, from the ledger;
                                         ?advise=1 rent or buy, ?estimate=1 the predicted wait's error
                                         (&features=1: and each request's admission record, for fitting)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, get_args

from fastapi import APIRouter

from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.service import Gateway
from lmfleet.overflow.advise import advise as advise_rows
from lmfleet.overflow.advise import facts_from_rows, replica_hour_nusd
from lmfleet.overflow.estimate_error import estimate_errors, samples_from_rows
from lmfleet.overflow.admission import admission_rows
from lmfleet.store import Grouping, StoreUnavailable

log = logging.getLogger("lmfleet.gateway")

USAGE_FLUSH_WAIT_S = 5.0
"""/admin/usage waits at most this long for finished requests' rows to reach the ledger before it reads."""


def usage_routes(gw: Gateway) -> APIRouter:
    """``/admin/usage`` for one gateway process."""
    r = APIRouter()

    @r.get("/admin/usage")
    async def admin_usage(since: float | None = None, until: float | None = None,
                          by: str = "served_by", advise: bool = False, estimate: bool = False,
                          features: bool = False) -> dict[str, Any]:
        """Requests, tokens and cost per ``served_by`` or per ``tenant`` (rows without one: ``default``), read from
        the ledger (the fleet's shared PostgreSQL when ``ledger.url`` is set); 503 while that cannot be reached.
        ``advise=1``: rent or buy per model instead (``lmfleet usage --advise``); ``estimate=1``: the predicted
        local wait's error per model instead (``lmfleet usage --estimate``), with ``features=1`` also ``requests``:
        every request with an estimate and an admission record (``lmfleet.overflow.admission``), oldest first."""
        ledger = gw.recorder.ledger
        if ledger is None:
            raise GatewayError(404, "No ledger is configured.")
        if by not in get_args(Grouping):
            raise GatewayError(400, f"by must be one of {list(get_args(Grouping))}, got {by!r}", param="by")
        if advise and estimate:
            raise GatewayError(400, "advise and estimate: choose one", param="estimate")
        if features and not estimate:
            raise GatewayError(400, "features=1 goes with estimate=1", param="features")
        try:  # rows of finished requests are in before we read (bounded: the database may be down)
            await asyncio.wait_for(gw.recorder.flush(), USAGE_FLUSH_WAIT_S)
        except TimeoutError:
            log.warning("admin/usage: %d ledger rows still waiting to be written; reading without them",
                        gw.recorder.pending)
        try:
            if advise or estimate:
                raw = await asyncio.to_thread(ledger.rows, since, until)
            else:
                rows = await asyncio.to_thread(ledger.summary, since, until, by)
                total = await asyncio.to_thread(ledger.totals, since, until, by)
        except StoreUnavailable as e:
            raise GatewayError(503, f"The ledger cannot be read now: {e}") from None
        if estimate:
            thresholds = {n: m.threshold_ms for n, m in gw.models.items()}
            errors = estimate_errors(samples_from_rows(raw), thresholds)
            got = {"since": since, "until": until, "models": [e.as_dict(thresholds.get(e.model)) for e in errors]}
            return {**got, "requests": admission_rows(raw)} if features else got
        if advise:
            hourly = {n: replica_hour_nusd(m.app.cfg, uses_gpus=m.app.device == "gpu") for n, m in gw.models.items()}
            window = (since, until if until is not None else time.time()) if since is not None else None
            advice = advise_rows(facts_from_rows(raw), hourly, window=window)
            return {"since": since, "until": until, "models": [a.as_dict() for a in advice]}
        return {"since": since, "until": until, "by": by, "rows": [row.as_dict() for row in rows],
                "total": total.as_dict()}

    return r
