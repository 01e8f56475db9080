"""What the relay drives one attempt of a request through: the :class:`Backend` protocol and its :class:`Ask`.

The relay (:mod:`lmfleet.gateway.relay.run`) calls a backend in this order::

    slot = await backend.acquire(ask)          # admission (breaker, caps, budget) + counted in flight; None: skip
        ... call backend.endpoint(...) ...
        backend.first_token(slot)              # streams only
        backend.finish(slot, output_tokens)    # success
        | backend.fail(slot, err)              # failed before anything reached the client
        | backend.break_stream(slot, ...)      # failed mid-stream
        | backend.cancel(slot)                 # the client went away: neutral
    cost = backend.charge(input_tokens, output_tokens)

The two implementations (a local deployment, an external provider) are routing's
(:mod:`lmfleet.gateway.routing.backends`); the relay knows only this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lmfleet.gateway.core.errors import UpstreamError
from lmfleet.gateway.relay.upstream import Endpoint
from lmfleet.overflow import Reason
from lmfleet.store import Cap


@dataclass(frozen=True)
class Ask:
    """What admission needs to know of one attempt."""

    request_id: str
    prompt_tokens: int
    """The count or an estimate (for the load tracker)."""
    prompt_upper: int | None
    """Never below the real count (None: unknown): what a budget reservation holds for."""
    max_tokens: int | None
    max_model_len: int | None
    spend_caps: tuple[Cap, ...] = ()
    """The tenant's own spend caps (hourly/daily USD on paid providers), reserved beside the fleet's."""
    streamed: bool = True
    """The answer is streamed: the gateway sees its first token (the load tracker's prefill work ahead)."""


class Backend(Protocol):
    """Something one attempt of a request can be sent to (see the module docstring for the call order)."""

    label: str
    """Provenance (``local/MODEL``, ``provider/NAME``): the x-lmfleet-served-by header, ledger and metrics label."""
    fallback_reason: Reason
    """The route reason a request reports when a later backend serves it after this one failed."""
    needs_exact_prompt: bool
    """:meth:`acquire` reserves money on the prompt's token count (a provider under a budget): the relay counts the
    prompt exactly before asking, instead of passing the cheap upper bound."""

    def endpoint(self, model: str, *, has_fallback: bool) -> Endpoint: ...
    async def acquire(self, ask: Ask) -> Any | None: ...
    def first_token(self, slot: Any) -> None: ...
    def finish(self, slot: Any, output_tokens: int) -> None: ...
    def fail(self, slot: Any, err: UpstreamError) -> None: ...
    def break_stream(self, slot: Any, output_tokens: int, *, timed_out: bool) -> None: ...
    def cancel(self, slot: Any) -> None: ...
    def attempts(self, *, last: bool) -> int: ...
    def backoff_s(self, k: int, last_error: UpstreamError | None) -> float: ...
    def charge(self, input_tokens: int, output_tokens: int) -> float: ...
