"""Workload mixes: parsing, validation messages, seeded sampling with exact token counts."""

import random

import pytest

from lmfleet.bench.workload import (BenchInputError, PromptSynthesizer, TokenDist, check_context, load_dataset,
                                    load_mix, mix_from_dict, parse_mix_inline, parse_token_dist, sample_requests,
                                    with_weights)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lmfleet.models import resolve_source

    return AutoTokenizer.from_pretrained(resolve_source("builtin:tiny-random", progress=lambda *_: None))


@pytest.fixture(scope="module")
def synth(tokenizer):
    return PromptSynthesizer(tokenizer)


@pytest.mark.parametrize("value, expected", [
    (128, TokenDist(128, 128)),
    ("64-512", TokenDist(64, 512)),
    ("7", TokenDist(7, 7)),
    ({"min": 10, "max": 20}, TokenDist(10, 20)),
    ({"dist": "normal", "mean": 100, "std": 10, "min": 50, "max": 150}, TokenDist(50, 150, "normal", 100, 10)),
])
def test_parse_token_dist(value, expected):
    assert parse_token_dist(value, "x") == expected


@pytest.mark.parametrize("value, message", [
    ("abc", "is not a token count"),
    ("1-2-3", "is not a token count"),
    ("0-5", "need 1 <= LO <= HI"),
    ("9-5", "need 1 <= LO <= HI"),
    ({"dist": "zipf", "min": 1, "max": 2}, "expected 'uniform' or 'normal'"),
    (True, "is not a token count"),
])
def test_parse_token_dist_errors(value, message):
    with pytest.raises(BenchInputError, match=message):
        parse_token_dist(value, "x")


def test_token_dist_sample_stays_in_range():
    rng = random.Random(1)
    d = TokenDist(50, 150, "normal", 100, 80)
    assert all(50 <= d.sample(rng) <= 150 for _ in range(500))


@pytest.mark.parametrize("spec, message", [
    ("a:0.5:10:10,b:0.4:10:10", "weights sum to 0.9"),
    ("a:0.5:10:10,a:0.5:10:10", "duplicate class name"),
    ("a:1:10", "expected NAME:WEIGHT:INPUT_TOKENS:OUTPUT_TOKENS"),
    ("a:x:10:10", "weight='x' is not a number"),
    ("a:1:10:10:embed", "api='embed'"),
    ("a:-1:10:10,b:2:10:10", "weights must be > 0"),
])
def test_inline_mix_errors(spec, message):
    with pytest.raises(BenchInputError, match=message):
        parse_mix_inline(spec)


def test_inline_mix_and_percent_weights():
    mix = parse_mix_inline("short:60:64-512:32:chat,long:40:4096-8192:512:completion")
    assert [c.name for c in mix.classes] == ["short", "long"]
    assert mix.classes[1].api == "completion" and mix.classes[1].input_tokens == TokenDist(4096, 8192)
    assert mix.max_total_tokens == 8192 + 512


@pytest.mark.parametrize("data, message", [
    ({}, "non-empty 'classes'"),
    ({"classes": [{"name": "a", "weight": 1, "input_tokens": 5}]}, "missing 'output_tokens'"),
    ({"classes": [{"name": "a", "weight": 1, "input_tokens": 5, "output_tokens": 5, "colour": 1}]},
     "unknown key"),
    ({"classes": [], "seed": 1}, "non-empty 'classes'"),
    ({"classes": [{"name": "a", "weight": 1, "input_tokens": 5, "output_tokens": 5}], "sed": 1}, "unknown key"),
])
def test_mix_file_errors(data, message):
    with pytest.raises(BenchInputError, match=message):
        mix_from_dict(data)


def test_load_mix_from_yaml_file(tmp_path):
    p = tmp_path / "mix.yaml"
    p.write_text("seed: 7\nclasses:\n  - {name: a, weight: 0.25, input_tokens: 10-20, output_tokens: 5}\n"
                 "  - {name: b, weight: 0.75, input_tokens: 30, output_tokens: 5, api: completion}\n")
    mix = load_mix(str(p))
    assert mix.seed == 7 and [c.weight for c in mix.classes] == [0.25, 0.75]
    with pytest.raises(BenchInputError, match="does not exist"):
        load_mix(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("overrides, message", [
    ({"nope": 0.5}, r"unknown class name\(s\) \['nope'\]"),
    ({"a": 0.9}, "weights sum to 1.4"),
])
def test_with_weights_errors(overrides, message):
    mix = parse_mix_inline("a:0.5:10:10,b:0.5:10:10")
    with pytest.raises(BenchInputError, match=message):
        with_weights(mix, overrides)


def test_with_weights_applies():
    mix = with_weights(parse_mix_inline("a:0.5:10:10,b:0.5:10:10"), {"a": 0.2, "b": 0.8})
    assert [c.weight for c in mix.classes] == [0.2, 0.8]


@pytest.mark.parametrize("max_model_len, ok", [(None, True), (2048, True), (2047, False)])
def test_check_context(max_model_len, ok):
    mix = parse_mix_inline("a:1:1000-1536:100-512")
    if ok:
        check_context(mix, max_model_len)
    else:
        with pytest.raises(BenchInputError, match="exceeds the model's context"):
            check_context(mix, max_model_len)


def test_sampling_is_seeded_and_exact(tokenizer, synth):
    mix = parse_mix_inline("c:0.6:40-300:8-32:chat,p:0.4:200-900:16:completion")
    first = sample_requests(mix, 40, synth, seed=3)
    assert first == sample_requests(mix, 40, PromptSynthesizer(tokenizer), seed=3)
    assert first != sample_requests(mix, 40, synth, seed=4)
    for r in first:
        if r.api == "chat":
            assert synth.count_chat(r.messages[0]["content"]) == r.input_tokens
            assert 40 <= r.input_tokens <= 300 and 8 <= r.max_tokens <= 32
        else:
            assert len(tokenizer(r.prompt).input_ids) == r.input_tokens
            assert 200 <= r.input_tokens <= 900 and r.max_tokens == 16
    assert {r.cls for r in first} == {"c", "p"}


def test_class_weights_are_respected(synth):
    mix = parse_mix_inline("a:0.8:20:1:completion,b:0.2:20:1:completion")
    share = sum(r.cls == "a" for r in sample_requests(mix, 500, synth, seed=0)) / 500
    assert 0.74 < share < 0.86


def test_chat_prompt_below_template_overhead_is_an_input_error(synth):
    with pytest.raises(BenchInputError, match="below this API's fixed prompt overhead"):
        synth.chat(2, random.Random(0))


def test_dataset_sharegpt_and_jsonl(tmp_path, tokenizer):
    sg = tmp_path / "sg.json"
    sg.write_text('[{"conversations": [{"from": "human", "value": "the dog"}, {"from": "gpt", "value": "is"}]},'
                  ' {"conversations": [{"from": "human", "value": "of France"}]}]')
    reqs = load_dataset(sg, 5, seed=0, tokenizer=tokenizer, max_tokens_default=9)
    assert len(reqs) == 5 and {r.messages[0]["content"] for r in reqs} <= {"the dog", "of France"}
    assert all(r.max_tokens in (1, 9) or r.max_tokens >= 1 for r in reqs)
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": "bye"}\n')
    reqs = load_dataset(jl, 2, seed=0, tokenizer=None, api="completion")
    assert sorted(r.prompt for r in reqs) == ["bye", "hello"] and {r.api for r in reqs} == {"completion"}
    bad = tmp_path / "bad.json"
    bad.write_text('[{"x": 1}]')
    with pytest.raises(BenchInputError, match="no usable entries"):
        load_dataset(bad, 1, 0, None)
