"""``request_router: prefix_aware`` that also works behind direct streaming (Ray Serve 2.60; docs/routing.md).

Ray's ``PrefixCacheAffinityRouter`` learns where prompts went in ``on_request_routed``, which Serve calls only
when Serve itself sends the request. Under direct streaming (``gateway.serve_proxy: haproxy``, lmfleet's
default) HAProxy asks Serve's ingress router (``LLMRouter``, ``POST /internal/route``) for a replica and sends
the request itself: the router calls ``handle.choose_replica(..., _reserve=False)``, takes the *first* replica
of the first rank it gets, and Serve calls neither ``on_request_routed`` nor ``on_send_request``. Left alone,
Ray's router then

- never inserts a prompt into its prefix tree, so no prompt ever matches and every request goes to "the
  replicas with the least text", all tied at zero characters, of which the caller takes the first: one
  replica gets everything (seen: 36 of 36 requests on one replica, docs/routing.md);
- judges the hot-spot guard on queue lengths Serve cached up to 10 s earlier, never bumped by its own picks.

:class:`PrefixAffinityRouter` keeps Ray's behaviour when Serve sends the request itself (``serve_proxy: serve``)
and, on the pick-only path (recognised by the request arriving as the ``SimpleNamespace`` LLMRouter builds from
the body), returns exactly one replica, chosen by :func:`pick` on fresh load estimates (:class:`LoadBook`), and
inserts the prompt into the tree for it (what ``on_request_routed`` does on Serve's own path).

A request that carries no prompt (no ``messages``/``prompt``: e.g. the raw HTTP request that HAProxy's fallback
Serve proxy forwards to ``LLMServer`` at start-up or on a pin-miss, or an embeddings body) is routed like the
default router (power of two choices) and left out of the tree. Ray's class raises ``ValueError`` there, inside
Serve's routing task, and the request is never routed: it hangs until a timeout (seen 2026-12-01, docs/routing.md).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from ray.serve.llm.request_router import PrefixCacheAffinityRouter

from lmfleet import ray_private

logger = logging.getLogger("ray.serve")

IMBALANCED, PREFIX, LEAST_TEXT = "imbalanced", "prefix", "least_text"
"""Why :func:`pick` chose: the hot-spot guard, the longest cached prefix, or the replica with least text."""


def pick(loads: Mapping[str, int], *, imbalance_threshold: float, matched: Sequence[str] | None,
         match_rate: float, match_rate_threshold: float, least_text: Sequence[str] | None,
         rng: random.Random) -> tuple[str, str]:
    """One replica for one request, and why (Ray's PrefixCacheAffinityRouter's rule, made to return one replica).

    ``loads``: requests in flight per candidate replica. Guard first: when ``max - min > imbalance_threshold``
    prefixes are ignored. Else the replicas holding the longest match of the prompt (``matched``) if the match
    covers at least ``match_rate_threshold`` of it, else those with the least text in the tree (``least_text``).
    Among the chosen set (all candidates if it names none of them): the least loaded, ties at random.
    """
    if not loads:
        raise ValueError("pick needs at least one candidate replica")
    if max(loads.values()) - min(loads.values()) > imbalance_threshold:
        pool, why = list(loads), IMBALANCED
    elif matched and match_rate >= match_rate_threshold:
        pool, why = [r for r in matched if r in loads], PREFIX
    else:
        pool, why = [r for r in least_text or () if r in loads], LEAST_TEXT
    pool = pool or list(loads)
    low = min(loads[r] for r in pool)
    return rng.choice(sorted(r for r in pool if loads[r] == low)), why


class LoadBook:
    """Requests in flight per replica, as the pick-only router can know them: the replica's own count at the
    last probe that answered, plus the picks made since that probe was sent (their requests may not have reached
    the replica yet, and Serve tells this router nothing when they start or end). Picks older than ``pick_ttl_s``
    no longer count: by then their requests reached the replica, and when probes stop answering in time the
    estimate must not grow with every pick (it would hold the guard open and end affinity for good)."""

    def __init__(self, pick_ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.pick_ttl_s, self._clock = pick_ttl_s, clock
        self._probed: dict[str, tuple[int, float]] = {}
        self._picks: dict[str, deque[float]] = {}

    def probe_sent(self) -> float:
        """When a probe goes out; hand it back to :meth:`probed` with the answers."""
        return self._clock()

    def probed(self, answers: Mapping[str, int | None], sent_at: float) -> None:
        for rid, queue_len in answers.items():
            if queue_len is not None and sent_at >= self._probed.get(rid, (0, -math.inf))[1]:
                self._probed[rid] = (queue_len, sent_at)

    def picked(self, rid: str) -> None:
        self._picks.setdefault(rid, deque()).append(self._clock())

    def load(self, rid: str) -> int:
        queue_len, at = self._probed.get(rid, (0, -math.inf))
        picks = self._picks.get(rid, deque())
        now = self._clock()
        while picks and picks[0] <= now - self.pick_ttl_s:
            picks.popleft()
        return queue_len + sum(1 for t in picks if t > at)


def pick_only_prompt(pending_request: Any) -> Any | None:
    """The request body LLMRouter routes on under direct streaming (a ``SimpleNamespace``), else None."""
    args = getattr(pending_request, "args", None) or ()
    return args[0] if args and isinstance(args[0], SimpleNamespace) else None


class PrefixAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's PrefixCacheAffinityRouter, plus the pick-only path of direct streaming (module docstring)."""

    LOG_EVERY = 200
    """Log how the pick-only decisions split (prefix / least_text / imbalanced) every this many picks."""

    def initialize_state(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_state(*args, **kwargs)
        self._book = LoadBook()
        self._rng = random.Random()
        self._why: Counter[str] = Counter()

    def _prompt_text(self, pending_request: Any) -> str | None:
        """The prompt Ray's router would match on, or None where the request carries none."""
        if pending_request is None or not getattr(pending_request, "args", None):
            return None
        try:
            return self._extract_text_from_request(pending_request)
        except ValueError:  # Ray's way of saying: no messages or prompt among the arguments
            return None

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        text = self._prompt_text(pending_request)
        if text is None and pending_request is not None:
            default_router = ray_private.power_of_two_choices_router()
            return await default_router.choose_replicas(self, candidate_replicas, pending_request)
        if pick_only_prompt(pending_request) is None or not candidate_replicas or not text:
            return await super().choose_replicas(candidate_replicas, pending_request)
        chosen = await self._pick_one(text, candidate_replicas)
        return [[chosen]]

    def on_request_routed(self, pending_request, replica_id, result):
        if self._prompt_text(pending_request) is not None:
            super().on_request_routed(pending_request, replica_id, result)

    async def _pick_one(self, text: str, candidates):
        by_id = {r.replica_id.to_full_id_str(): r for r in candidates}
        sent_at = self._book.probe_sent()
        answers = await self._probe_queue_lens(candidates, 0)
        self._book.probed({r.replica_id.to_full_id_str(): q for r, q in answers}, sent_at)
        loads = {rid: self._book.load(rid) for rid in by_id}
        matched, match_rate, least = None, 0.0, None
        if max(loads.values()) - min(loads.values()) <= self._imbalanced_threshold:
            matched_text, matched = await self._tree_actor.prefix_match.remote(text, list(by_id))
            match_rate = len(matched_text) / len(text)
            if match_rate < self._match_rate_threshold:
                least = await self._tree_actor.get_smallest_tenants.remote()
        # the loads again, after the awaits above: picks made meanwhile by concurrent requests (a burst routes many
        # at once) must count, or they all see the same idle replicas and all follow the prefix (CI saw a flood of
        # 32, 16 at a time, go 30 / 2 with threshold 2). From here to picked() nothing awaits: check-then-pick is
        # atomic on this event loop
        loads = {rid: self._book.load(rid) for rid in by_id}
        rid, why = pick(loads, imbalance_threshold=self._imbalanced_threshold, matched=matched,
                        match_rate=match_rate, match_rate_threshold=self._match_rate_threshold, least_text=least,
                        rng=self._rng)
        self._book.picked(rid)
        # not awaited: the tree actor runs this caller's calls in order, so the next match sees it
        self._tree_actor.insert.remote(text, rid, time.time())
        self._why[why] += 1
        if sum(self._why.values()) % self.LOG_EVERY == 0:
            logger.info("prefix_aware (direct streaming) picks so far: %s", dict(self._why))
        return by_id[rid]
