"""Local attempts waiting in Serve's queue for a missing replica move on (:mod:`lmfleet.gateway.relay.replicaless`):
released attempts raise NoReplica, a client's own cancellation stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from lmfleet.gateway.relay.replicaless import NoReplica, WaitingForReplica


async def _waiting(w: WaitingForReplica, answer: asyncio.Future) -> str:
    with w.watch():
        return await answer


async def test_release_raises_no_replica_in_the_waiting_attempts() -> None:
    w = WaitingForReplica()
    answer: asyncio.Future = asyncio.get_running_loop().create_future()
    tasks = [asyncio.ensure_future(_waiting(w, answer)) for _ in range(3)]
    await asyncio.sleep(0)
    assert len(w) == 3 and w.release() == 3
    for t in tasks:
        with pytest.raises(NoReplica):
            await t
        assert t.cancelling() == 0  # nothing left of the cancellation that moved it
    assert len(w) == 0 and w.release() == 0


async def test_a_client_cancellation_stays_one_released_or_not() -> None:
    w = WaitingForReplica()
    answer: asyncio.Future = asyncio.get_running_loop().create_future()
    alone, both = asyncio.ensure_future(_waiting(w, answer)), asyncio.ensure_future(_waiting(w, answer))
    await asyncio.sleep(0)
    alone.cancel()
    both.cancel()
    assert w.release() == 2
    for t in (alone, both):
        with pytest.raises(asyncio.CancelledError):
            await t


async def test_an_answer_before_release_is_kept_and_a_second_release_does_nothing() -> None:
    w = WaitingForReplica()
    answer: asyncio.Future = asyncio.get_running_loop().create_future()
    t = asyncio.ensure_future(_waiting(w, answer))
    await asyncio.sleep(0)
    answer.set_result("done")
    assert await t == "done" and len(w) == 0 and w.release() == 0


async def test_an_attempt_that_swallows_the_release_keeps_its_answer_and_no_pending_cancel() -> None:
    w = WaitingForReplica()

    async def stubborn() -> str:
        with w.watch():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass  # e.g. a client library that finishes its answer on cancellation
            return "answer"

    t = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    w.release()
    assert await t == "answer" and t.cancelling() == 0
