"""The provenance headers of every answer the gateway relays (who served it, why, at what predicted wait)."""

from __future__ import annotations

SERVED_BY = "x-lmfleet-served-by"
"""The backend that answered (``local/MODEL``, ``provider/NAME``)."""
ROUTE_REASON = "x-lmfleet-route-reason"
"""Why it went there (:class:`lmfleet.overflow.Reason`)."""
QUEUE_ESTIMATE = "x-lmfleet-queue-estimate-ms"
"""The predicted local wait the route was decided on."""
HEDGED = "x-lmfleet-hedged"
"""``1``: a provider attempt ran beside the local one (overflow.policy hedge)."""
UPSTREAM_MODEL = "x-lmfleet-upstream-model"
"""The model name the backend answered with (the client's own name is in the body)."""
