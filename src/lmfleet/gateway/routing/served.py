"""A model the gateway serves (:class:`ServedModel`): its resolved record, tokenizer, backends and live routing
state, and how large a request's prompt is for it (:meth:`ServedModel.prompt_size`, the pipeline's size stage)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from lmfleet.engine.app import ModelApp
from lmfleet.gateway.core.request import ParsedRequest, check_context
from lmfleet.gateway.routing.backends import LocalBackend, ProviderBackend
from lmfleet.gateway.core.tokens import count_prompt_tokens, template_overhead, token_bounds
from lmfleet.gateway.relay.prefillgate import gate_on
from lmfleet.overflow import HysteresisState, OverflowMode
from lmfleet.overflow.margin import MissMargin
from lmfleet.overflow.policies import PolicyTimers
from lmfleet.tenants.queue import DispatchQueue


@dataclass
class ServedModel:
    """A model the gateway serves: its resolved record, tokenizer, backends and live routing state."""

    app: ModelApp
    tokenizer: Any | None
    local: LocalBackend
    providers: list[ProviderBackend]
    """Providers that may take its overflow, in priority order (``overflow.providers_for``)."""
    threshold_ms: float
    mode: OverflowMode = OverflowMode.AUTO
    hysteresis: HysteresisState = field(default_factory=HysteresisState)
    last_estimate_ms: float = 0.0
    queue: DispatchQueue | None = None
    """The priority queue in front of its local slots (None: no tenants configured; Serve's FIFO queue only)."""
    timers: PolicyTimers = field(default_factory=PolicyTimers)
    """``overflow.policy`` and its timers (the operator may change them at run time: POST /admin/overflow)."""
    prefill_gate: bool | Literal["auto"] = False
    """``overflow.prefill_gate`` (the operator may change it: POST /admin/overflow); :attr:`gated` says whether it
    is on now."""
    gate_line: bool = True
    """Price a request that would pass the prefill gate on the gate's service line (:func:`gate_wait_s
    <lmfleet.overflow.estimator.gate_wait_s>`); False: on the prefill line, as an ungated one (POST /admin/overflow
    ``gate_line``)."""
    margin: MissMargin = field(default_factory=MissMargin)
    """How much longer than predicted its recent near-threshold local requests waited (``overflow.miss_quantile``)."""
    _peers_overflowing: tuple[float, bool] = field(default=(0.0, False), repr=False)

    PEERS_OVERFLOWING_TTL_S = 2.0
    """A peer's overflowing flag older than this (the registry stopped answering) no longer counts."""

    @property
    def gated(self) -> bool:
        """Its streamed local requests pass :attr:`LocalBackend.gate
        <lmfleet.gateway.routing.backends.LocalBackend.gate>` now (:func:`gate_on
        <lmfleet.gateway.relay.prefillgate.gate_on>` of :attr:`prefill_gate`, its engine's device and its providers)."""
        return gate_on(self.prefill_gate, self.app.device, bool(self.providers))

    def set_peers_overflowing(self, flag: bool, now: float) -> None:
        """Another gateway of the fleet reports this model overflowing
        (:class:`~lmfleet.gateway.routing.peers.PeerBoard`; ``now`` on the monotonic clock)."""
        self._peers_overflowing = (now, flag)

    def peers_overflowing(self, now: float | None = None) -> bool:
        at, flag = self._peers_overflowing
        return flag and (time.monotonic() if now is None else now) - at <= self.PEERS_OVERFLOWING_TTL_S
    _template_overhead: int | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.app.name

    def provider(self, name: str) -> ProviderBackend:
        """Its provider named ``name`` (one of :attr:`providers`)."""
        return next(p for p in self.providers if p.name == name)

    async def prompt_size(self, req: ParsedRequest) -> PromptSize:
        """The prompt's size in tokens; 400 when prompt + max_tokens cannot fit in the context.

        When a bound computed without tokenizing proves that it fits (short chats against a long context: the
        common case), the tokenizer is skipped and an estimate stands in for the count. Otherwise (long prompts)
        the count starts in a worker thread and the size carries it as :attr:`PromptSize.exact`: the request
        goes upstream meanwhile and :meth:`~lmfleet.gateway.relay.run.RequestRun.answer` awaits the count (and
        its 400) before anything reaches the client, so counting hides behind the engine's prefill instead of
        adding to the time to first token (benchmarks/bench_front_door.py).
        """
        limit = self.app.max_model_len
        if self._template_overhead is None:
            self._template_overhead = template_overhead(self.tokenizer) if self.tokenizer is not None else 0
        bounds = token_bounds(req.kind, req.body, self._template_overhead)
        if self.tokenizer is not None and bounds is not None:
            tok = self.tokenizer

            def count() -> Awaitable[int | None]:
                return checked_count(tok, req, limit)
            if limit and bounds[0] + (req.max_tokens or 1) <= limit:
                return PromptSize(bounds[1], bounds[0], count=count)
            return PromptSize(bounds[1], bounds[0], asyncio.ensure_future(count()), count)
        n = await checked_count(self.tokenizer, req, limit)
        if n is not None:
            return PromptSize(n, n)
        # no tokenizer: a bound with room for an unknown chat template, else the context itself
        upper = bounds[0] + UNKNOWN_TEMPLATE_TOKENS if bounds is not None else limit
        return PromptSize(bounds[1] if bounds is not None else 0, upper)


async def checked_count(tok: Any | None, req: ParsedRequest, limit: int | None) -> int | None:
    """The prompt's exact token count (None: no tokenizer); 400 when prompt + max_tokens exceed ``limit``."""
    n = await count_prompt_tokens(tok, req.kind, req.body)
    if n is not None and limit:
        check_context(n, req.max_tokens, limit)
    return n


@dataclass(frozen=True)
class PromptSize:
    tokens: int
    """The count (exact when the tokenizer ran, else an estimate): for records and the load tracker."""
    upper: int | None
    """Never below the real count (None: unknown): for budget reservations, which must not under-hold."""
    exact: asyncio.Future[int | None] | None = None
    """The exact count while it is being computed (raises the context-length 400); None: nothing pending."""
    count: Callable[[], Awaitable[int | None]] | None = None
    """Computes the exact count where :attr:`tokens` is an estimate (a paid provider's reservation wants it)."""


UNKNOWN_TEMPLATE_TOKENS = 512
