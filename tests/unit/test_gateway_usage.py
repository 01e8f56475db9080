"""Pure parts of reading providers' answers: usage wherever it is, the text of an answer without usage, the
model an answer names, and how long a provider's error headers ask the gateway to wait."""

from __future__ import annotations

import json

import pytest

from lmfleet.gateway.relay import sse
from lmfleet.gateway.relay.rewrite import rename_model, rewrite, take_usage
from lmfleet.gateway.relay.upstream import parse_duration, retry_after_from
from lmfleet.gateway.relay.usage import StreamText, answer_text, answered_model, count_usage, stream_text
from lmfleet.testing.gateway_fakes import CountingTokenizer

U = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize("obj,usage", [
    ({"choices": [], "usage": U}, (5, 3)),  # OpenAI, Azure, DeepSeek, OpenRouter: a chunk of its own
    ({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": U}, (5, 3)),  # Together, Fireworks
    ({"choices": [{"index": 0, "delta": {}}], "x_groq": {"id": "req_1", "usage": U}}, (5, 3)),  # Groq
    ({"choices": [{"index": 0, "delta": {}}], "x_groq": {"id": "req_1"}}, None),
    ({"choices": [], "usage": None}, None),  # Together's and OpenAI's chunks before the last
    ({"usage": {"prompt_tokens": "5", "completion_tokens": 3}}, None),
    ({"usage": {"prompt_tokens": -1, "completion_tokens": 3}}, None),
    ({"usage": U, "x_groq": {"usage": {"prompt_tokens": 9, "completion_tokens": 9}}}, (5, 3)),  # usage first
])
def test_usage_wherever_the_provider_puts_it(obj, usage):
    assert sse.usage_of(obj) == usage


@pytest.mark.parametrize("wants_usage", [False, True])
@pytest.mark.parametrize("last", [
    {"id": "x", "model": "up", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": U},
    {"id": "x", "model": "up", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
     "x_groq": {"id": "r", "usage": U}},
])
def test_usage_in_the_last_content_chunk_is_read_and_the_chunk_kept(last, wants_usage):
    first = {"id": "x", "model": "up", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None}
    block = ev(first) + ev(last) + sse.DONE + b"\n\n"
    out, usage = take_usage(block, None, wants_usage)
    assert usage == (5, 3) and sse.count_choices(out) == 2
    out2, chunks, usage2, done, failed = rewrite(sse.split_events(block), None, False, "m", wants_usage)
    assert (chunks, usage2, done, failed) == (2, (5, 3), True, False)
    objs = [sse.event_json(e) for e in sse.split_events(out2)][:2]
    assert [o["model"] for o in objs] == ["m", "m"]
    assert ("usage" in objs[1]) == (wants_usage and "usage" in last)


@pytest.mark.parametrize("event", [
    {"choices": [], "created": 0, "id": "", "model": "", "object": "", "prompt_filter_results": []},  # Azure's first
    {"id": "x", "model": "gpt-4o-mini-2024-07-18", "choices": [{"index": 0, "delta": {"content": "a"}}]},
])
def test_every_chunk_carries_the_clients_model_name(event):
    out, *_ = rewrite([json.dumps(event, indent=None).join([b"data: ".decode(), "\n\n"]).encode()], None, False,
                      "tiny", False)
    assert sse.event_json(out)["model"] == "tiny"


@pytest.mark.parametrize("head,model", [
    (ev({"choices": [], "model": ""}) + ev({"model": "gpt-4o-mini-2024-07-18", "choices": []}),
     "gpt-4o-mini-2024-07-18"),
    (b'data: {"id":"x","model":"a\\"b","choices":[]}\n\n', 'a"b'),
    (b": OPENROUTER PROCESSING\n\n" + ev({"model": "openai/gpt-4o", "choices": []}), "openai/gpt-4o"),
    (ev({"choices": [{"index": 0, "text": "x"}]}), None),
    (b"", None),
])
def test_answered_model(head, model):
    assert answered_model(head) == model


TOOL = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}


@pytest.mark.parametrize("obj,text", [
    ({"choices": [{"message": {"role": "assistant", "content": "Paris is nice."}}]}, "Paris is nice."),
    ({"choices": [{"message": {"content": "A", "reasoning_content": "think "}}]}, "Athink "),
    ({"choices": [{"message": {"content": None, "tool_calls": [TOOL]}}]}, 'get_time\n{"tz": "UTC"}'),
    ({"choices": [{"text": "one two"}, {"text": " three"}]}, "one two three"),  # completions, n=2
    ({"choices": []}, ""),
    ({"error": {"message": "x"}}, ""),
])
def test_answer_text(obj, text):
    assert answer_text(obj) == text


def test_stream_text_gathers_content_reasoning_and_tool_call_pieces():
    events = [b": OPENROUTER PROCESSING\n\n",
              ev({"choices": [], "prompt_filter_results": []}),
              ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
              ev({"choices": [{"index": 0, "delta": {"content": None, "reasoning_content": "hm "}}]}),
              ev({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
              ev({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                                                      "function": {"name": "f", "arguments": ""}}]}}]}),
              ev({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}),
              b"data: [DONE]\n\n"]
    assert stream_text([b"".join(events[:3]), b"".join(events[3:])]) == "hm Hif\n{}"


@pytest.mark.parametrize("kind,body,text,guess,chunks,usage", [
    ("chat", {"messages": [{"role": "user", "content": "a b c"}]}, "x y", 0, 0, (4, 2)),  # +1: generation prompt
    ("chat", {"messages": [{"role": "user", "content": "a"}], "tools": [{"function": {"name": "f g"}}]}, "", 0, 0,
     (2 + 2, 0)),  # tool definitions count as prompt
    ("completions", {"prompt": "a b c d"}, "x", 0, 0, (4, 1)),
])
def test_count_usage_with_the_tokenizer(kind, body, text, guess, chunks, usage):
    assert count_usage(CountingTokenizer(), kind, body, text, guess, chunks) == usage


class WatchedTokenizer(CountingTokenizer):
    """A CountingTokenizer that notes every text it is given."""

    def __init__(self):
        self.seen = []

    def encode(self, text, add_special_tokens=True):
        self.seen.append(text)
        return super().encode(text, add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        self.seen += [m["content"] for m in messages]
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


@pytest.mark.parametrize("kind,body,text,counted,usage", [
    ("chat", {"messages": [{"role": "user", "content": "a b c"}]}, "x y", 40, (40, 2)),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "tools": [{"function": {"name": "f g"}}]}, "", 40,
     (40 + 2, 0)),  # tool definitions are not part of the earlier count
    ("completions", {"prompt": "a b c d"}, None, 40, (40, 3)),
])
def test_count_usage_takes_a_prompt_already_counted(kind, body, text, counted, usage):
    tok = WatchedTokenizer()
    assert count_usage(tok, kind, body, text, 0, 3, prompt_counted=counted) == usage
    assert not any("a" in t.split() for t in tok.seen)  # the prompt's words were not tokenized again


@pytest.mark.parametrize("text,chunks,usage", [("abcdefgh", 0, (11, 2)), ("ab", 5, (11, 5)), ("", 0, (11, 0))])
def test_count_usage_without_a_tokenizer_uses_the_guess(text, chunks, usage):
    assert count_usage(None, "chat", {"messages": []}, text, 11, chunks) == usage


@pytest.mark.parametrize("value,seconds", [
    ("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("2m59.56s", 179.56), ("1h2m3s", 3723.0), ("7.66s", 7.66),
    ("3", 3.0), ("", None), (None, None), ("soon", None), ("1s junk", None),
])
def test_parse_duration(value, seconds):
    got = parse_duration(value)
    assert got == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize("headers,seconds", [
    ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),  # OpenAI, Azure: the precise one first
    ({"retry-after": "2"}, 2.0),
    ({"retry-after-ms": "nan", "retry-after": "2"}, 2.0),
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s",
      "x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "50s"}, 1.5),  # the exhausted one
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "7.66s",
      "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2m59.56s"}, 179.56),  # both: longest
    ({"x-ratelimit-reset-requests": "3s", "x-ratelimit-reset-tokens": "1s"}, 1.0),  # none exhausted: soonest
    ({"X-RateLimit-Reset": "1764763200000", "X-RateLimit-Remaining": "0"}, None),  # OpenRouter's epoch: not a wait
    ({}, None),
])
def test_retry_after_from_provider_headers(headers, seconds):
    from multidict import CIMultiDict

    got = retry_after_from(CIMultiDict(headers))
    assert got == (pytest.approx(seconds) if seconds is not None else None)


@pytest.mark.parametrize("compact_bytes", [1, 100, 1 << 20])
def test_stream_text_keeps_the_same_text_whenever_it_compacts(compact_bytes):
    blocks = [ev({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}) for i in range(50)]
    kept = StreamText(compact_bytes)
    for b in blocks:
        kept.add(b)
    assert kept.text() == "".join(f" w{i}" for i in range(50)) == stream_text(blocks)


def test_count_usage_of_a_stream_whose_text_was_not_kept_counts_its_chunks():
    assert count_usage(CountingTokenizer(), "completions", {"prompt": "a b"}, None, 0, 7) == (2, 7)


# ---- the client's model name put back as bytes (rename_model) ---------------------------------------------------
OPENAI_CHUNK = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini-2024-07-18",'
                b'"system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}],'
                b'"usage":null}\n\n')


@pytest.mark.parametrize("event,drop,out", [
    (OPENAI_CHUNK, False, OPENAI_CHUNK.replace(b'"gpt-4o-mini-2024-07-18"', b'"tiny"')),
    (OPENAI_CHUNK, True, OPENAI_CHUNK.replace(b'"gpt-4o-mini-2024-07-18"', b'"tiny"').replace(b',"usage":null', b"")),
    (b'data: {"id": "x", "model": "a", "choices": [{"delta": {"content": "\xc3\xa9"}}], "usage": null}\n\n', True,
     b'data: {"id": "x", "model": "tiny", "choices": [{"delta": {"content": "\xc3\xa9"}}]}\n\n'),  # spaces, UTF-8
    (b'data:{"model":"","choices":[]}\n\n', False, b'data:{"model":"tiny","choices":[]}\n\n'),  # Azure's first
    # parsed instead: not one plain data line, a nested or repeated name, odd values, usage elsewhere
    (b"data: [DONE]\n\n", True, None),
    (b": OPENROUTER PROCESSING\n\n", True, None),
    (b'event: x\ndata: {"model":"a","choices":[]}\n\n', True, None),
    (b'data: {"model":"a",\ndata: "choices":[]}\n\n', True, None),
    (b'data: {"x":{"model":"a"},"choices":[]}\n\n', True, None),
    (b'data: {"choices":[{"model":"a"}]}\n\n', True, None),
    (b'data: {"model":"a","choices":[],"y":{"model":"b"}}\n\n', True, None),
    (b'data: {"model":"a\\"b","choices":[]}\n\n', True, None),
    (b'data: {"model":null,"choices":[]}\n\n', True, None),
    (b'data: {"id":"{","model":"a","choices":[]}\n\n', True, None),
    (b'data: {"model":"a","usage":null,"choices":[]}\n\n', True, b'data: {"model":"tiny","choices":[]}\n\n'),
    (b'data: {"id": "x", "usage": null, "model": "a", "choices": []}\n\n', True,
     b'data: {"id": "x", "model": "tiny", "choices": []}\n\n'),  # the fake's openai dialect
    (b'data: {"model":"a","choices":[{"usage":null}],"usage":null}\n\n', True, None),
    (b'data: {"model":"a","choices":[{"delta":{}}],"usage":null,"x":1}\n\n', True, None),
    (b'data: {"usage":null}\n\n', True, None),
    (b'data: {"model":"a","choices":[],"usage":{"prompt_tokens":1}}\n\n', True, None),
    (b'data: {"error":{"message":"boom"},"model":"a"}\n\n', True, None),
    (b'data: {"model":"a","error":{"message":"boom"}}\n\n', True, b'data: {"model":"tiny","error":{"message":"boom"}}\n\n'),
    (b"data: not json\n\n", True, None),
])
def test_rename_model_as_bytes(event, drop, out):
    got = rename_model(event, b'"tiny"', drop_null_usage=drop)
    assert got == out
    if got is not None:  # what parsing it would have sent, as JSON
        slow = sse.event_json(event)
        slow["model"] = "tiny"
        if drop and slow.get("usage", 0) is None:
            del slow["usage"]
        assert sse.event_json(got) == slow


@pytest.mark.parametrize("wants_usage", [False, True])
def test_renamed_stream_read_in_pieces_matches_parsing_each_event(wants_usage):
    """A provider's stream cut anywhere between reads: the events renamed as bytes carry what parsing gives."""
    events = [OPENAI_CHUNK,
              b'data: {"id":"x","model":"gpt-4o","choices":[{"delta":{"content":"\xe2\x82\xac \\"q\\""}}],"usage":null}\n\n',
              b'data: {"id":"x","model":"gpt-4o","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
              b'"total_tokens":7}}\n\n',
              b'data: {"error":{"message":"m","type":"t"}}\n\n',
              b"data: [DONE]\n\n"]
    raw = b"".join(events)
    for cut in range(1, len(raw), 7):
        splitter = sse.SSESplitter()
        out = b"".join(rewrite(sse.split_events(block), None, False, "tiny", wants_usage)[0]
                       for block in (splitter.feed_block(raw[:cut]), splitter.feed_block(raw[cut:])) if block)
        got = [sse.event_json(e) for e in sse.split_events(out)]
        assert [o["model"] for o in got if o and "choices" in o] == ["tiny"] * (3 if wants_usage else 2)
        assert [("usage" in o) for o in got if o and "choices" in o] == ([True] * 3 if wants_usage else [False] * 2)
        assert got[-2] == {"error": {"message": "m", "type": "t"}} and out.endswith(b"data: [DONE]\n\n")
        assert got[1]["choices"][0]["delta"]["content"] == '\u20ac "q"'
    _, chunks, usage, done, failed = rewrite(sse.split_events(raw), None, False, "tiny", wants_usage)
    assert (chunks, usage, done, failed) == (2, (5, 2), True, True)
