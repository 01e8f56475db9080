"""Pure parts of the gateway: SSE splitting, health mapping, request validation, message cleaning."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from lmfleet.gateway.relay import sse
from lmfleet.gateway.front.errors import GatewayError
from lmfleet.gateway.routing.health import HealthBoard, model_health
from lmfleet.gateway.relay.upstream import clean_message
from lmfleet.gateway.relay.rewrite import rewrite, take_usage
from lmfleet.gateway.front.validation import check_context, validate_request


@pytest.mark.parametrize("chunks,events", [
    ([b"data: a\n\n"], [b"data: a\n\n"]),
    ([b"data: a\n", b"\ndata: b\n\n"], [b"data: a\n\n", b"data: b\n\n"]),
    ([b"data: a\r\n\r\ndata: b"], [b"data: a\n\n"]),
    ([b"da", b"ta: [DONE]\n\n"], [b"data: [DONE]\n\n"]),
])
def test_sse_splitter(chunks, events):
    s = sse.SSESplitter()
    got = []
    for c in chunks:
        got += s.feed(c)
    assert got == events


@pytest.mark.parametrize("chunks,events,rest", [
    # "\r\n" split across reads, at the end of a line and in the blank line
    ([b"data: a\r", b"\n\r\ndata: b\r\n\r", b"\n"], [b"data: a\n\n", b"data: b\n\n"], b""),
    ([b"data: a\r\n\r", b"\n"], [b"data: a\n\n"], b""),
    # the blank line itself split between reads, after events were taken from the first read
    ([b"data: a\n\ndata: b\n", b"\n"], [b"data: a\n\n", b"data: b\n\n"], b""),
    # blank events and comments-only keep-alives: blanks are dropped, comments are events
    ([b"\n\n\n\n: ping\n\n"], [b": ping\n\n"], b""),
    # an unfinished event stays for rest(), including a trailing "\r"
    ([b"data: a\n\ndata: b\r"], [b"data: a\n\n"], b"data: b\r"),
])
def test_sse_splitter_line_ends_and_rest(chunks, events, rest):
    s = sse.SSESplitter()
    got = [e for c in chunks for e in s.feed(c)]
    assert got == events and s.rest() == rest


@pytest.mark.parametrize("chunks", [
    [b"data: " + b"x" * 100],  # an event that never ends
    [b"data: " + b"x" * 50, b"y" * 50],  # ... across reads
    [b"data: " + b"x" * 100 + b"\n\n"],  # a complete event over the limit in one read
])
def test_sse_splitter_bounds_an_event(chunks):
    s = sse.SSESplitter(max_event_bytes=64)
    with pytest.raises(sse.SSEEventTooLarge, match="64-byte limit") as ei:
        for c in chunks:
            s.feed(c)
    assert isinstance(ei.value, ValueError) and ei.value.limit == 64
    assert s.rest() == b""  # what it held is dropped
    assert s.feed(b"data: ok\n\n") == [b"data: ok\n\n"]


class _CountingSplitter(sse.SSESplitter):
    """Counts the bytes each search for an event's end looks at (deterministic, unlike a timing)."""

    scanned = 0

    def _split(self, buf, scan_from):
        self.scanned += len(buf) - scan_from
        return super()._split(buf, scan_from)


@pytest.mark.parametrize("kib", [1, 16, 128])
def test_sse_splitter_scans_each_byte_once(kib):
    """An event fed a byte at a time is searched about once per byte (rescanning the buffer: ~n²/2 bytes)."""
    event = b"data: " + b"x" * (kib << 10)
    s = _CountingSplitter()
    for i in range(len(event)):
        s.feed(event[i:i + 1])
    assert s.rest() == event
    assert s.scanned <= 2 * len(event), (s.scanned, len(event))


@pytest.mark.parametrize("event,usage", [
    (b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\n', (3, 5)),
    (b'data: {"choices":[{"index":0}],"usage":null}\n\n', None),
    (b"data: [DONE]\n\n", None),
    (b"data: not json\n\n", None),
])
def test_usage_of_events(event, usage):
    assert sse.usage_of(sse.event_json(event)) == usage


def _app(status, deployments):
    return NS(status=NS(value=status), deployments={
        n: NS(status=NS(value=s), replica_states=r, message=m) for n, (s, r, m) in deployments.items()})


@pytest.mark.parametrize("app,ready,words", [
    (None, False, "not deployed"),
    (_app("RUNNING", {"LLMServer:m": ("HEALTHY", {"RUNNING": 1}, ""), "OpenAiIngress": ("HEALTHY", {"RUNNING": 1}, "")}),
     True, "serving"),
    (_app("DEPLOYING", {"LLMServer:m": ("UPDATING", {"STARTING": 1}, "slow init")}), False, "UPDATING: slow init"),
    (_app("RUNNING", {"LLMServer:m": ("UPSCALING", {"RUNNING": 1, "STARTING": 1}, "")}), True, "serving"),
    (_app("UNHEALTHY", {"LLMServer:m": ("UNHEALTHY", {"RUNNING": 0}, "health check failed")}), False, "health check"),
    (_app("UNHEALTHY", {"LLMServer:m": ("UNHEALTHY", {"RUNNING": 1}, "node died")}), True, "degraded: "),
    (_app("DEPLOY_FAILED", {"LLMServer:m": ("DEPLOY_FAILED", {}, "EngineDeadError")}), False, "EngineDeadError"),
])
def test_model_health(app, ready, words):
    h = model_health(app)
    assert h.ready is ready and words in h.message


@pytest.mark.parametrize("states,replicaless", [
    ({"RUNNING": 1}, False),
    ({"STARTING": 1}, True),  # the successor starting, nothing before it: a request waits in Serve's queue
    ({"STOPPING": 1, "STARTING": 1}, False),  # the old replica finishes what it holds: a request may be on it
    ({"RUNNING": 0, "STARTING": 2}, True),
    ({"PENDING_MIGRATION": 1, "STARTING": 1}, False),  # on a draining node, still serving
    ({"RECOVERING": 1}, False),
    ({}, True),  # deploy failed, no replica at all
])
def test_model_health_replicaless(states, replicaless):
    h = model_health(_app("DEPLOYING", {"LLMServer:m": ("UPDATING", states, "")}))
    assert h.replicaless is replicaless


def test_not_deployed_is_not_replicaless():
    assert model_health(None).replicaless is False


def _details(status, deployments):
    """The controller's details dict as Ray 2.60 returns it: enum members for states, replicas as dicts."""
    return {"applications": {"lmfleet-m": {"status": NS(value=status), "message": "", "deployments": {
        n: {"status": NS(value=s), "message": m, "replicas": [{"state": NS(value=x)} for x in states]}
        for n, (s, states, m) in deployments.items()}}}}


@pytest.mark.parametrize("details,ready,running,words", [
    ({"applications": {}}, False, 0, "not deployed"),
    (_details("RUNNING", {"LLMServer:m": ("HEALTHY", ["RUNNING", "RUNNING"], "")}), True, 2, "serving"),
    (_details("RUNNING", {"LLMServer:m": ("UPSCALING", ["RUNNING", "STARTING"], "")}), True, 1, "serving"),
    (_details("DEPLOYING", {"LLMServer:m": ("UPDATING", ["STARTING"], "slow init")}), False, 0, "UPDATING: slow init"),
    (_details("UNHEALTHY", {"LLMServer:m": ("UNHEALTHY", ["RUNNING"], "node died")}), True, 1, "node died"),
])
def test_status_overview_maps_details_like_serve_status(details, ready, running, words):
    from lmfleet.gateway.routing.health import status_overview

    h = model_health(status_overview(details).get("lmfleet-m"))
    assert (h.ready, h.running_replicas) == (ready, running) and words in h.message


def test_health_board_mark_failed_holds_until_next_poll_window():
    b = HealthBoard({"m": "lmfleet-m"}, fetch=None)
    assert b.is_ready("m")
    b.mark_failed("m", "engine died")
    assert not b.is_ready("m") and not b.all_ready()


@pytest.mark.parametrize("events,ready", [
    (["break"], True),
    (["break", "break"], True),
    (["break", "break", "break"], False),
    (["break", "break", "ok", "break", "break"], True),  # a success in between starts the count again
    (["break", "break", "break", "ok"], True),  # and lifts the mark
])
def test_health_board_needs_consecutive_stream_breaks(events, ready):
    b = HealthBoard({"m": "lmfleet-m"}, fetch=None)
    for e in events:
        b.note_stream_break("m", "local stream broke") if e == "break" else b.mark_ok("m")
    assert b.is_ready("m") is ready


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "temperature": True}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"model": "m", "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "stream_options": "yes"}, "stream_options"),
])
def test_completion_validation(body, param):
    with pytest.raises(GatewayError) as ei:
        validate_request("completion", body)
    assert ei.value.status == 400 and ei.value.param == param


def test_valid_requests_parse():
    p = validate_request("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                                  "stream_options": {"include_usage": True}, "max_completion_tokens": 5})
    assert p.stream and p.wants_usage and p.max_tokens == 5


@pytest.mark.parametrize("prompt,max_tokens,limit,ok", [
    (10, 10, 20, True), (10, 11, 20, False), (19, None, 20, True), (20, None, 20, False)])
def test_check_context(prompt, max_tokens, limit, ok):
    if ok:
        check_context(prompt, max_tokens, limit)
    else:
        with pytest.raises(GatewayError, match=str(limit)):
            check_context(prompt, max_tokens, limit)


@pytest.mark.parametrize("raw,clean", [
    ("Message: temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0) (Request ID: 5), "
     "Internal exception: X (Request ID: 5), original exception: ",
     "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
    ("plain message", "plain message"),
])
def test_clean_message(raw, clean):
    assert clean_message(raw) == clean


@pytest.mark.parametrize("chunks", [
    [b"data: a\n\n"],
    [b"data: a\n", b"\ndata: b\n\n"],
    [b"data: a\r\n\r\ndata: b"],
    [b"da", b"ta: [DONE]\n\n"],
    [b"data: a\r", b"\n\r\ndata: b\r\n\r", b"\n"],
    [b"data: a\n\ndata: b\n", b"\n"],
    [b"\n\n\n\n: ping\n\n"],
    [b"data: a\n\ndata: b\r"],
    [b"data: 1\n\n", b"data: 2\n\ndata: 3\n", b"\ndata: 4", b"\n\n"],
    [b"data: 1\n\n", b"d", b"ata: [DONE]\n\n"],  # one byte: no "\n\n" in it, nothing complete
    [b"d", b"\n", b"\n"],
])
def test_feed_block_gives_the_same_events_as_feed(chunks):
    """The relay's block splitter and the per-event one agree on events and rest, whatever the read edges."""
    a, b = sse.SSESplitter(), sse.SSESplitter()
    events = [e for c in chunks for e in a.feed(c)]
    blocks = [b.feed_block(c) for c in chunks]
    assert all(blk.endswith(b"\n\n") or blk == b"" for blk in blocks)
    assert sse.split_events(b"".join(blocks)) == events and b.rest() == a.rest()


def test_feed_block_bounds_the_unfinished_event():
    s = sse.SSESplitter(max_event_bytes=64)
    assert s.feed_block(b"data: ok\n\ndata: " + b"x" * 40) == b"data: ok\n\n"
    with pytest.raises(sse.SSEEventTooLarge, match="64-byte limit"):
        s.feed_block(b"y" * 40)
    assert s.rest() == b"" and s.feed_block(b"data: ok\n\n") == b"data: ok\n\n"


@pytest.mark.parametrize("raw, refused", [
    pytest.param(b'{"model":"m","messages":[{"role":"user","content":"hi \\u00e9"}]}', False, id="plain-chat"),
    pytest.param(b'{"a":"\\ud800"}', True, id="lone-surrogate"),
    pytest.param(b'{"a":"\\uDBFF x"}', True, id="lone-surrogate-upper-case"),
    pytest.param(b'{"\\udc00":1}', True, id="lone-surrogate-in-a-key"),
    pytest.param(b'{"a":"\\ud83d\\ude00"}', False, id="surrogate-pair"),
    pytest.param('{"a":"\\ud800"}'.encode("utf-16-le"), True, id="utf-16-body"),
    pytest.param(b'{"a":' + b"[" * 70 + b"]" * 70 + b"}", True, id="too-deep"),
    pytest.param(b'{"a":' + b"[" * 60 + b"]" * 60 + b"}", False, id="deep-but-allowed"),
    pytest.param(b'{"a":"' + b"[" * 100 + b'"}', False, id="brackets-in-a-string"),
])
def test_parse_json_refuses_the_same_bodies_with_the_quick_scan(raw, refused):
    """The scan that skips the tree walk never lets through a body the walk would refuse."""
    from lmfleet.gateway.front.errors import GatewayError
    from lmfleet.gateway.front.validation import _may_need_tree_check, parse_json

    try:
        parse_json(raw)
        got = False
    except GatewayError:
        got = True
    assert got == refused
    if refused:
        assert _may_need_tree_check(raw)


_CHUNK = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n'
_USAGE = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
_USAGE_IN_CHOICE = b'data: {"id":"x","choices":[{"index":0,"delta":{}}],"usage": {"prompt_tokens":3,"completion_tokens":2}}\n\n'
_NULL_USAGE = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"n"}}],"usage":null}\n\n'


@pytest.mark.parametrize("block", [
    pytest.param(_CHUNK % 1 + _CHUNK % 2 + _USAGE + b"data: [DONE]\n\n", id="whole-stream"),
    pytest.param(_USAGE, id="usage-alone"),
    pytest.param(_USAGE + b"data: [DONE]\n\n", id="usage-then-done"),
    pytest.param(_CHUNK % 1 + _USAGE_IN_CHOICE + b"data: [DONE]\n\n", id="usage-in-a-choice-chunk"),
    pytest.param(_NULL_USAGE + _CHUNK % 1 + _USAGE, id="null-usage-is-a-plain-chunk"),
    pytest.param(_USAGE + _USAGE, id="two-usage-events"),
])
@pytest.mark.parametrize("wants_usage", [False, True])
def test_taking_usage_from_a_block_matches_the_event_by_event_path(block, wants_usage):
    """The relay's quick usage path (only the usage event is parsed) sends what the slow path sends."""
    quick, quick_usage = take_usage(block, None, wants_usage)
    slow, chunks, slow_usage, done, failed = rewrite(sse.split_events(block), None, False, None, wants_usage)
    assert (quick, quick_usage) == (slow, slow_usage) and quick_usage == (3, 2)
    assert sse.count_choices(quick) == chunks and not failed


@pytest.mark.parametrize("block, answered", [
    (b"", False),
    (b'data: {"choices":[]}\n\n', False),                                     # a usage-only or empty chunk
    (b': ping\n\n', False),                                                    # a comment
    (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n', True),         # vLLM's first chunk
    (b': ping\n\ndata: {"choices": [{"text":"a"}]}\n\n', True),               # after a comment
    (b'\n\ndata: [DONE]\n\n', True),                                           # a blank event, then the end
    (b'data: {"error": {"message": "boom"}}\n\n', True),
    (b'data: {"choices":[{"text":"a"}]}\n\n' * 40 + b"data: [DONE]\n\n", True),  # a whole answer in one read
    (b'data: {"choices":[{"text":"a"}]}', False),                              # not a whole event
])
def test_first_answer_in_a_block(block, answered):
    from lmfleet.gateway.relay.sse import first_answer_in, has_choices, split_events

    assert first_answer_in(block) is answered
    # agrees with looking at every event
    events = split_events(block) if block.endswith(b"\n\n") else []
    assert answered == any(has_choices(e) or e.lstrip().startswith(b"data: [DONE]") or b'"error"' in e
                           for e in events)
