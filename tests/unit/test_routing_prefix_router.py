"""prefix_aware on the pick-only path of direct streaming (lmfleet.engine.prefix_router; docs/routing.md).

The decision (:func:`pick`) and the load estimate (:class:`LoadBook`) are pure; the router itself runs here with
Ray's real prefix tree (``PrefixTree``, the class behind Ray's tree actor) behind a stand-in for the actor handle,
and fake replica probes: no Ray cluster.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from lmfleet.engine.prefix_router import (IMBALANCED, LEAST_TEXT, PREFIX, LoadBook, PrefixAffinityRouter, pick,
                                          pick_only_prompt)


@pytest.mark.parametrize("loads, matched, rate, least, expect, why", [
    ({"a": 0, "b": 0}, ["a"], 0.9, None, {"a"}, PREFIX),
    ({"a": 2, "b": 0}, ["a"], 0.9, None, {"a"}, PREFIX),  # within the guard (2 - 0 <= 2): affinity wins
    ({"a": 3, "b": 0}, ["a"], 0.9, None, {"b"}, IMBALANCED),  # beyond it: the least loaded
    ({"a": 0, "b": 0}, ["a"], 0.05, ["b"], {"b"}, LEAST_TEXT),  # match too short: least text
    ({"a": 0, "b": 1}, ["a", "b"], 0.9, None, {"a"}, PREFIX),  # both hold it: the less loaded
    ({"a": 0, "b": 0}, ["a", "b"], 0.9, None, {"a", "b"}, PREFIX),  # tie: either (not always the first)
    ({"a": 0, "b": 0}, None, 0.0, None, {"a", "b"}, LEAST_TEXT),  # empty tree: any
    ({"a": 1, "b": 0}, ["gone"], 0.9, None, {"b"}, PREFIX),  # matched replica no longer a candidate
    ({"a": 0}, None, 0.0, ["a"], {"a"}, LEAST_TEXT),
])
def test_pick(loads, matched, rate, least, expect, why):
    seen = {pick(loads, imbalance_threshold=2, matched=matched, match_rate=rate, match_rate_threshold=0.1,
                 least_text=least, rng=random.Random(seed)) for seed in range(20)}
    assert {r for r, _ in seen} == expect
    assert {w for _, w in seen} == {why}


def test_pick_without_candidates_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        pick({}, imbalance_threshold=2, matched=None, match_rate=0, match_rate_threshold=0.1, least_text=None,
             rng=random.Random(0))


def test_load_book_counts_picks_made_since_the_probe_was_sent():
    now = [0.0]
    book = LoadBook(pick_ttl_s=2.0, clock=lambda: now[0])
    book.picked("a")
    now[0] = 0.1
    book.picked("a")
    assert (book.load("a"), book.load("b")) == (2, 0)
    sent = book.probe_sent()
    now[0] = 0.2
    book.picked("a")  # while the probe is out: its request may not be in the answer
    book.probed({"a": 1, "b": 4}, sent)
    assert (book.load("a"), book.load("b")) == (2, 4)
    book.probed({"a": 0}, sent - 1)  # an older probe answering late changes nothing
    assert book.load("a") == 2
    now[0] = 0.3
    book.probed({"a": None}, book.probe_sent())  # no answer in time: the estimate stays
    assert book.load("a") == 2


def test_load_book_forgets_picks_after_their_ttl_when_probes_do_not_answer():
    now = [0.0]
    book = LoadBook(pick_ttl_s=2.0, clock=lambda: now[0])
    for i in range(10):
        now[0] = i * 0.5
        book.picked("a")
    assert book.load("a") == 4  # picks at 3.0, 3.5, 4.0, 4.5: the last 2 s


@pytest.mark.parametrize("pending, is_pick_only", [
    (SimpleNamespace(args=[SimpleNamespace(messages=[{"role": "user", "content": "x"}])]), True),
    (SimpleNamespace(args=[{"messages": []}]), False),  # Serve's own path hands a parsed request object
    (SimpleNamespace(args=[]), False),
    (None, False),
])
def test_pick_only_path_is_recognised_by_llmrouters_namespace(pending, is_pick_only):
    assert (pick_only_prompt(pending) is not None) == is_pick_only


class _Call:
    """What ``actor.method.remote(...)`` returns here: already run (like an actor running calls in order),
    awaitable like an ObjectRef, and harmless when nobody awaits it."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # noqa: unreachable; makes this a generator


class _Tree:
    def __init__(self, tree):
        self.tree = tree

    def __getattr__(self, name):
        method = getattr(self.tree, name)
        return SimpleNamespace(remote=lambda *a: _Call(method(*a)))


@pytest.fixture
def router():
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    dep = DeploymentID(name="LLMServer", app_name="smollm2")

    class Probed(PrefixAffinityRouter):
        """Replicas answer probes with ``queue`` (None: they answer nothing in time)."""

        queue: dict | None = None

        async def _probe_queue_lens(self, replicas, backoff_index):
            q = self.queue or {}
            return [(r, q.get(r.replica_id.unique_id)) for r in replicas]

    r = Probed(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    tree = PrefixTree()
    r.initialize_state(imbalanced_threshold=2, match_rate_threshold=0.1, tree_actor=_Tree(tree))
    r.replicas = [SimpleNamespace(replica_id=ReplicaID(unique_id=u, deployment_id=dep)) for u in ("r1", "r2")]
    tree.add_tenants([x.replica_id.to_full_id_str() for x in r.replicas], 0.0)
    return r


def route(router, system: str, user: str) -> str:
    pending = SimpleNamespace(args=[SimpleNamespace(messages=[{"role": "system", "content": system},
                                                              {"role": "user", "content": user}])])
    [[chosen]] = asyncio.run(router.choose_replicas(router.replicas, pending))
    return chosen.replica_id.unique_id


SYSTEM_A, SYSTEM_B = "You are a careful assistant. " * 40, "Answer in French, briefly and politely. " * 30


def test_shared_prefix_sticks_and_a_new_prefix_goes_to_the_replica_with_less_text(router):
    router.queue = {"r1": 0, "r2": 0}  # sequential: every probe finds the replicas idle
    first = route(router, SYSTEM_A, "warm up")
    assert {route(router, SYSTEM_A, f"question {i}") for i in range(10)} == {first}
    other = route(router, SYSTEM_B, "bonjour")
    assert other != first
    assert {route(router, SYSTEM_B, f"question {i}") for i in range(5)} == {other}
    assert router._why == {LEAST_TEXT: 2, PREFIX: 15}


def test_a_burst_of_one_prefix_spreads_once_picks_exceed_the_guard(router):
    router.queue = None  # a burst: no probe answers in time, the router counts its own picks
    got = [route(router, SYSTEM_A, f"flood {i}") for i in range(12)]
    first = got[0]
    assert got[:3] == [first] * 3  # affinity until the pick count passes the guard (threshold 2)
    assert 4 <= got.count(first) <= 8, got  # then the guard keeps the two within 3 of each other
    router.queue = {"r1": 0, "r2": 0}  # the burst is over: the probe resets the estimate, affinity is back
    assert route(router, SYSTEM_A, "flood 0") == first  # only the first replica holds this whole prompt


class _YieldingCall(_Call):
    """A remote call that, like a real one, lets other routing tasks run before it answers."""

    def __await__(self):
        yield  # one turn of the event loop (a bare yield inside a Task)
        return self.value


def test_a_concurrent_burst_of_one_prefix_spreads_too(router):
    # Serve routes a burst's requests concurrently: each awaits its probe and the tree actor before it picks, so the
    # picks the others made meanwhile must count (before the fix: all 12 on the affine replica)
    router.queue = None
    tree = router._tree_actor.tree
    router._tree_actor = SimpleNamespace(**{
        name: SimpleNamespace(remote=(lambda m: lambda *a: _YieldingCall(m(*a)))(getattr(tree, name)))
        for name in ("prefix_match", "get_smallest_tenants", "insert")})
    route(router, SYSTEM_A, "warm up")

    async def burst() -> list[str]:
        pending = [SimpleNamespace(args=[SimpleNamespace(messages=[{"role": "system", "content": SYSTEM_A},
                                                                   {"role": "user", "content": f"flood {i}"}])])
                   for i in range(12)]
        got = await asyncio.gather(*(router.choose_replicas(router.replicas, p) for p in pending))
        return [chosen.replica_id.unique_id for [[chosen]] in got]

    got = asyncio.run(burst())
    assert 4 <= max(got.count("r1"), got.count("r2")) <= 8, got


def _no_prompt(arg) -> SimpleNamespace:
    """A request as Serve's routing task holds it, whose arguments carry no messages or prompt."""
    return SimpleNamespace(args=[arg] if arg is not None else [], kwargs={},
                           metadata=SimpleNamespace(multiplexed_model_id="", request_id="x"),
                           routing_context=SimpleNamespace(tried_same_node=False, tried_same_az=False,
                                                           should_backoff=False))


@pytest.mark.parametrize("arg", [
    SimpleNamespace(scope={"type": "http", "path": "/v1/chat/completions"}),  # HAProxy's fallback Serve proxy
    SimpleNamespace(input="embed me"),  # a body without messages or prompt
    None,  # no arguments at all
])
def test_a_request_without_a_prompt_is_routed_like_the_default_router_and_kept_out_of_the_tree(router, arg):
    """Ray's class raises ValueError here, inside Serve's routing task: the request was never routed (it hung)."""
    router.queue = {"r1": 0, "r2": 0}
    ranks = asyncio.run(router.choose_replicas(router.replicas, _no_prompt(arg)))
    assert all(r in router.replicas for rank in ranks for r in rank)
    router.on_request_routed(_no_prompt(arg), router.replicas[0].replica_id, None)
    assert router._why == {}  # the pick-only decision never ran
    first = route(router, SYSTEM_A, "after")  # and the tree is still empty: least text, any replica
    assert router._why == {LEAST_TEXT: 1} and first in {"r1", "r2"}
