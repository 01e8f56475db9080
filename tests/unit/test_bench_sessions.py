"""Shared-prefix and multi-turn workload classes: parsing, validation messages, the sessions they produce."""

from __future__ import annotations

from collections import Counter

import pytest

from lmfleet.bench.workload import (BenchInputError, PrefixPool, PromptSynthesizer, TokenDist, check_context,
                                    load_mix, mix_from_dict, parse_mix_inline, sample_requests, with_weights)


@pytest.fixture(scope="module")
def synth():
    from transformers import AutoTokenizer

    from lmfleet.models import resolve_source

    return PromptSynthesizer(AutoTokenizer.from_pretrained(resolve_source("builtin:tiny-random",
                                                                          progress=lambda *_: None)))


def one(**extra) -> dict:
    return {"classes": [{"name": "a", "weight": 1, "input_tokens": 16, "output_tokens": 8, **extra}]}


@pytest.mark.parametrize("extra, prefixes, turns, sessions", [
    ({}, None, 1, 8),
    ({"system_prompts": {"count": 8, "tokens": 1000}}, PrefixPool(8, 1000), 1, 8),
    ({"system_prompts": "4x200", "turns": 4}, PrefixPool(4, 200), 4, 8),
    ({"system_prompts": {"count": 2, "tokens": 50, "hot_share": 0.9}, "sessions": 3}, PrefixPool(2, 50, 0.9), 1, 3),
    ({"turns": "3"}, None, 3, 8),
])
def test_session_class_options(extra, prefixes, turns, sessions):
    c = mix_from_dict(one(**extra)).classes[0]
    assert (c.prefixes, c.turns, c.sessions) == (prefixes, turns, sessions)


@pytest.mark.parametrize("extra, message", [
    ({"system_prompts": {"count": 0, "tokens": 10}}, "system_prompts.count: 0 is not a whole number from 1"),
    ({"system_prompts": {"count": 2}}, "expected {count: K, tokens: P, hot_share: H} or 'KxP'"),
    ({"system_prompts": "8by1000"}, "system_prompts.count: '8by1000' is not a whole number"),
    ({"system_prompts": {"count": 2, "tokens": 5, "hot_share": 1}}, "hot_share: 1; expected a share in [0, 1)"),
    ({"system_prompts": {"count": 2, "tokens": 5, "hot": 0.5}}, "expected {count: K"),
    ({"turns": 0}, "turns: 0 is not a whole number from 1 to 64"),
    ({"turns": 2.5}, "turns: 2.5 is not a whole number"),
    ({"sessions": True}, "sessions: True is not a whole number"),
    ({"prefix": "8x1000"}, "unknown key(s) ['prefix']"),
])
def test_session_class_errors(extra, message):
    with pytest.raises(BenchInputError) as ei:
        mix_from_dict(one(**extra), "mix.yaml")
    assert message in str(ei.value) and "mix.yaml: class 'a'" in str(ei.value)


@pytest.mark.parametrize("spec, prefixes, turns, sessions, api", [
    ("a:1:16:8:prefixes=8x1000:turns=4", PrefixPool(8, 1000), 4, 8, "chat"),
    ("a:1:16:8:completion:prefixes=2x64:hot=0.8:sessions=2", PrefixPool(2, 64, 0.8), 1, 2, "completion"),
    ("a:1:16:8:turns=2", None, 2, 8, "chat"),
])
def test_inline_options(spec, prefixes, turns, sessions, api):
    c = parse_mix_inline(spec).classes[0]
    assert (c.prefixes, c.turns, c.sessions, c.api) == (prefixes, turns, sessions, api)


@pytest.mark.parametrize("spec, message", [
    ("a:1:16:8:shared=8x100", "unknown option 'shared'"),
    ("a:1:16:8:hot=0.5", "hot= needs prefixes=KxP"),
    ("a:1:16:8:turns=0", "turns: '0' is not a whole number"),
])
def test_inline_option_errors(spec, message):
    with pytest.raises(BenchInputError, match=message):
        parse_mix_inline(spec)


def test_yaml_file_and_weight_overrides_keep_the_options(tmp_path):
    p = tmp_path / "mix.yaml"
    p.write_text("classes:\n  - {name: a, weight: 50, input_tokens: 16, output_tokens: 8, turns: 3,\n"
                 "     system_prompts: {count: 2, tokens: 40}}\n  - {name: b, weight: 50, input_tokens: 8, "
                 "output_tokens: 8}\n")
    mix = with_weights(load_mix(str(p)), {"a": 70, "b": 30})
    assert (mix.classes[0].weight, mix.classes[0].turns, mix.classes[0].prefixes) == (70, 3, PrefixPool(2, 40))


@pytest.mark.parametrize("extra, max_model_len, ok", [
    ({"system_prompts": "1x100", "turns": 4}, 100 + 4 * 16 + 3 * 8 + 8, True),  # 196
    ({"system_prompts": "1x100", "turns": 4}, 195, False),
    ({"turns": 2}, 16 + 16 + 8 + 8, True),
])
def test_check_context_counts_the_whole_conversation(extra, max_model_len, ok):
    mix = mix_from_dict(one(**extra))
    if ok:
        check_context(mix, max_model_len)
    else:
        with pytest.raises(BenchInputError, match=r"system prompt 100 \+ 4 turns .* = 196 tokens exceeds"):
            check_context(mix, max_model_len)


def test_multi_turn_sessions_carry_the_conversation(synth):
    mix = mix_from_dict({"seed": 3, "classes": [{"name": "agent", "weight": 1, "input_tokens": 12,
                                                 "output_tokens": 6, "turns": 3, "sessions": 2,
                                                 "system_prompts": {"count": 2, "tokens": 40}}]})
    reqs = sample_requests(mix, 30, synth)
    assert reqs == sample_requests(mix, 30, synth)  # seeded
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) >= 10  # 30 requests, 3 turns each (the last sessions may be unfinished)
    for turns in by_session.values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for prev, cur in zip(turns, turns[1:]):
            assert cur.messages[:len(prev.messages)] == prev.messages  # the conversation so far, then more
            assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
            assert cur.input_tokens > prev.input_tokens
        first = turns[0]
        assert first.messages[0]["role"] == "system" and first.prefix in (0, 1)
        assert first.input_tokens == synth.count_messages(first.messages)  # exact, through the chat template
        assert len(synth.tok.encode(first.messages[-1]["content"], add_special_tokens=False)) == 12
    # sessions with the same prefix index share the system prompt text; the two prompts differ
    systems = {r.prefix: r.messages[0]["content"] for r in reqs}
    assert len(set(systems.values())) == 2


@pytest.mark.parametrize("hot_share, low, high", [(0.0, 0.05, 0.2), (0.9, 0.85, 0.97)])
def test_hot_prefix_share(synth, hot_share, low, high):
    mix = mix_from_dict({"classes": [{"name": "a", "weight": 1, "input_tokens": 4, "output_tokens": 2,
                                      "sessions": 1, "system_prompts": {"count": 8, "tokens": 8,
                                                                        "hot_share": hot_share}}]})
    reqs = sample_requests(mix, 1500, synth, seed=5)
    share0 = Counter(r.prefix for r in reqs)[0] / len(reqs)
    assert low <= share0 <= high  # uniform: 1/8; hot: 0.9 + 0.1/8


def test_completion_sessions_and_plain_classes_mix(synth):
    mix = parse_mix_inline("s:0.5:8:4:completion:prefixes=1x30:turns=2,p:0.5:32:4")
    reqs = sample_requests(mix, 40, synth, seed=1)
    plain = [r for r in reqs if r.cls == "p"]
    sess = [r for r in reqs if r.cls == "s"]
    assert plain and sess and all(r.session == "" and r.turn == 0 for r in plain)
    pool_text = next(r.prompt for r in sess if r.turn == 1)[:40]
    assert all(r.prompt.startswith(pool_text[:20]) for r in sess)  # one system prompt: every prompt starts with it
    assert all(r.input_tokens == synth.count_completion(r.prompt) for r in sess)


def test_prefix_pool_pick_is_in_range():
    import random

    rng = random.Random(0)
    assert {PrefixPool(3, 1).pick(rng) for _ in range(200)} == {0, 1, 2}
    assert TokenDist(1, 1).sample(rng) == 1


async def test_turn_order_holds_a_turn_until_the_previous_one_is_answered():
    import asyncio

    from lmfleet.bench.loadgen import TurnOrder
    from lmfleet.bench.workload import BenchRequest

    reqs = [BenchRequest("a", "chat", 1, 1, session="a/0", turn=t) for t in (1, 2, 3)]
    order, log = TurnOrder(len(reqs)), []

    async def send(i):
        await order.wait(i, reqs[i % 3])
        log.append(("start", i))
        await asyncio.sleep(0.01 * (3 - i % 3))  # earlier turns take longer
        log.append(("end", i))
        order.finish(i, reqs[i % 3])

    await asyncio.wait_for(asyncio.gather(*(send(i) for i in reversed(range(6)))), 5)
    for i in range(6):
        if i % 3:  # turn 2 and 3 of each pass start after the previous turn of the same pass ended
            assert log.index(("start", i)) > log.index(("end", i - 1))
    assert order._events.keys() <= {(0, "a/0", 3), (1, "a/0", 3)}  # only last turns' events remain


@pytest.mark.parametrize("plan_kwargs", [
    {"users": 4, "num_requests": 24},
    {"rate": 500.0, "num_requests": 24, "max_concurrency": 2},
])
def test_sessions_run_through_the_load_generator(synth, plan_kwargs):
    import asyncio

    from lmfleet.bench.loadgen import LoadPlan, Target, run_load
    from lmfleet.testing.fast_openai_server import FastServer

    mix = parse_mix_inline("a:1:16:4:prefixes=2x32:turns=3:sessions=3")
    reqs = sample_requests(mix, 12, synth)
    with FastServer("--itl-ms", "1") as srv:
        records, _ = asyncio.run(asyncio.wait_for(
            run_load(Target(srv.base_url, "fast"), reqs, LoadPlan(**plan_kwargs)), 60))
    assert len(records) == 24 and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]
