"""The tenant stage: who sent a request and what it may ask for.

    tenant = directory.resolve(key)                         authenticate: the client key names the tenant
    cls = tenancy.admit(tenant, model, headers)             the model is allowed (403), the priority class (400)
    plan = await router.route(model, tenant, cls, tokens)   the tenant's limits, counted with the route (429)

Its place in the model's local queue and its release at the end are the relay's
(:mod:`lmfleet.gateway.relay.localslot`).

The limits are checked inside :meth:`lmfleet.gateway.routing.router.Router.route` because admission and the
routing decision are one step there: a batch request's admission depends on the route (local within its deadline,
a provider only when its tenant allows it), and a request is counted only once it cannot be refused any more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lmfleet.config.tenants import PriorityClass
from lmfleet.gateway.core.errors import GatewayError
from lmfleet.tenants import PRIORITY_HEADER, PriorityHeaderError, Tenant, model_refusal, requested_class

TENANT_SCOPE_KEY = "lmfleet.tenant"
"""Where authentication leaves the caller's :class:`~lmfleet.tenants.Tenant` in the ASGI scope of a /v1 request."""


class Tenancy:
    """The checks a tenant's request passes before it is routed (the fleet's priority classes)."""

    def __init__(self, classes: Sequence[PriorityClass]):
        self.classes = classes
        """The fleet's classes (the tenant book's own sequence, not a copy)."""

    def admit(self, tenant: Tenant | None, model: str, headers: Mapping[str, str]) -> PriorityClass | None:
        """The request's priority class (None: no tenant). 403 when the tenant may not use ``model``, 400 for a
        priority header it may not ask for."""
        if tenant is None:
            return None
        if (refusal := model_refusal(tenant, model)) is not None:
            raise GatewayError(403, refusal["error"]["message"], param="model", code="model_not_allowed")
        try:
            return requested_class(headers.get(PRIORITY_HEADER), tenant, self.classes)
        except PriorityHeaderError as e:
            raise GatewayError(400, e.message, param=PRIORITY_HEADER, code="invalid_priority") from None
