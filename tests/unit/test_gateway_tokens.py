"""The gateway's token bound: proves a prompt fits without tokenizing it; never below the real count."""

from __future__ import annotations

import pytest

from lmfleet.gateway.core.tokens import (count_chat, count_completion, template_overhead, token_bounds,
                                            utf8_len)

TEXTS = [
    "What is the capital of France?",
    "",
    " " * 300,
    "1234567890" * 40,
    "🙂🚀🇫🇷" * 50,
    "東京は日本の首都です。" * 30,
    "a\nb\n\n\tc " * 80,
    "<|im_start|>system\n<|im_end|>" * 10,  # special-token look-alikes
    "x" * 2000,
]


@pytest.fixture(scope="module")
def tok():
    from lmfleet.models import resolve_source
    from lmfleet.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_source("builtin:tiny-random", progress=lambda *_: None))


@pytest.mark.parametrize("text", TEXTS)
def test_bound_is_never_below_the_real_count(tok, text):
    overhead = template_overhead(tok)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text},
            {"role": "assistant", "content": text[:10]}, {"role": "user", "content": [{"type": "text", "text": text}]}]
    upper, _ = token_bounds("chat", {"messages": msgs}, overhead)
    assert upper >= count_chat(tok, msgs)
    upper, _ = token_bounds("completion", {"prompt": text}, overhead)
    assert upper >= count_completion(tok, text)


@pytest.mark.parametrize("body, kind", [
    ({"prompt": [1, 2, 3]}, "completion"),  # token ids: count them exactly
    ({"prompt": ["a", "b"]}, "completion"),
    ({"messages": [{"role": "user", "content": 5}]}, "chat"),
])
def test_no_bound_for_prompts_that_are_not_plain_text(body, kind):
    assert token_bounds(kind, body, 10) is None


@pytest.mark.parametrize("text, n", [("", 0), ("abc", 3), ("é", 2), ("東京", 6), ("🙂", 4), ("\ud800", 3)])
def test_utf8_len(text, n):
    assert utf8_len(text) == n


@pytest.mark.parametrize("kind, body, upper", [
    ("completion", {"prompt": "the " * 100}, 402),  # ASCII: one token a byte at most (+2)
    ("completion", {"prompt": "東京"}, 8),
    ("chat", {"messages": [{"role": "user", "content": "the " * 100}]}, 400 + 10 + 16 + 4 + 1),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}]}, 2 + 10 + 16 + 4 + 1),
])
def test_bound_counts_bytes(kind, body, upper):
    assert token_bounds(kind, body, 10)[0] == upper


@pytest.mark.parametrize("text", TEXTS)
def test_chat_count_is_the_templates_own(tok, text):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert count_chat(tok, msgs) == len(ids["input_ids"] if hasattr(ids, "keys") else ids)
