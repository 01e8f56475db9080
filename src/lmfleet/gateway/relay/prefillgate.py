"""``overflow.prefill_gate``: a model's streamed local requests leave the gateway one prompt at a time per running
replica, each once the one before it has its first token.

Why: a vLLM engine prefills the prompts waiting at the start of a step together, within its token budget
(``max_num_batched_tokens``), and every one of them has its first token only when that step ends. A prompt sent
while the engine works on an earlier one therefore joins the earlier one's last step and delays its first token by
its own share of that step -- up to a whole step, seconds on a CPU engine -- which no estimate made when the earlier
request was admitted can know. With the gate the engine holds at most one prompt per replica before its first
token; the others wait in the gateway, first come first served, where the wait estimate already counts them
(their prompt tokens are prefill work ahead from the moment they are admitted: ``LoadTracker.on_start`` comes
first). What it costs: the engine no longer fills a step's leftover token budget with the next prompt, so each
prompt adds about one engine step (decoding only) and one gateway round trip to the prefill of the queue.

Non-streamed requests do not pass the gate: nothing tells the gateway when their first token came; nor do the local
attempts that the hedge and ttft_timeout policies race against their timer, which would not run while they wait.

Where (:func:`gate_on`): ``auto``, the default, turns it on for a model with a provider to overflow to whose engine
runs on CPU, where one prompt's step is a visible share of the threshold; on a GPU engine a step is short against
it, and without a provider the estimate decides nothing the gate would pay for.

    gate = PrefillGate()
    if await gate.enter(key, timeout_s):   # False: timed out, holds nothing
        ...                                # send upstream
    gate.leave(key)                        # first token, error, cancel or end; idempotent
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Literal

__all__ = ["PrefillGate", "gate_on"]


def gate_on(setting: bool | Literal["auto"], device: str, has_provider: bool) -> bool:
    """Whether a model's streamed local requests pass the gate: ``setting`` (``overflow.prefill_gate``, or the
    operator's run-time value) when true or false; ``auto``: with a provider to overflow to, on a ``cpu`` engine."""
    if setting == "auto":
        return has_provider and device == "cpu"
    return bool(setting)


class PrefillGate:
    """First come first served: at most :attr:`limit` keys hold the gate; the others wait in arrival order."""

    def __init__(self, limit: int = 1) -> None:
        self._limit = max(1, limit)
        self._holders: set[object] = set()
        self._waiting: OrderedDict[object, asyncio.Future[bool]] = OrderedDict()
        """Each waiting key's future: True when it is let in, False when it left before."""

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, n: int) -> None:
        """The number of running replicas (at least 1): a larger limit lets waiting keys in at once."""
        self._limit = max(1, n)
        self._grant()

    @property
    def holding(self) -> int:
        return len(self._holders)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def enter(self, key: object, timeout_s: float | None = None) -> bool:
        """Wait for the gate (at most ``timeout_s``). True: ``key`` holds it until :meth:`leave`; False: timed out
        (or :meth:`leave` came first), ``key`` holds nothing. Cancelled while waiting: ``key`` holds nothing, and the
        cancellation propagates."""
        if key in self._holders:
            return True
        if not self._waiting and len(self._holders) < self._limit:
            self._holders.add(key)
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[key] = fut
        try:
            if timeout_s is None:
                return await fut
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            self._drop(key)
            return False
        except BaseException:
            self._drop(key)
            raise

    def leave(self, key: object) -> None:
        """``key`` no longer holds or waits for the gate (idempotent); the next waiting key enters."""
        if key in self._holders:
            self._holders.discard(key)
            self._grant()
        else:
            fut = self._waiting.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(False)

    def _drop(self, key: object) -> None:
        """A waiter gave up: out of the queue, or, when the gate was granted meanwhile, out of the holders."""
        self._waiting.pop(key, None)
        if key in self._holders:
            self.leave(key)

    def _grant(self) -> None:
        while self._waiting and len(self._holders) < self._limit:
            key, fut = self._waiting.popitem(last=False)
            self._holders.add(key)
            fut.set_result(True)
