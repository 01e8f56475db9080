"""The foundation end to end: real CLI, real Ray Serve LLM, real vLLM (CPU) engines, real openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_a_plain_question_sensibly(fleet):
    raw = fleet.client().chat.completions.with_raw_response.create(
        model="smollm2", messages=QUESTION, max_tokens=40, temperature=0)
    assert raw.headers["x-lmfleet-served-by"] == "local/smollm2"
    assert raw.headers["x-lmfleet-route-reason"] == "local_ok"
    r = raw.parse()
    assert "paris" in r.choices[0].message.content.lower(), r.choices[0].message.content
    assert r.model == "smollm2"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


def test_completion(fleet):
    r = fleet.client().completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                          temperature=0)
    assert r.choices[0].text.strip()
    assert r.usage.completion_tokens <= 8


def test_chat_streaming_relays_chunks_as_they_come(fleet):
    # relayed one by one (the test fleet turns Ray Serve LLM's own 50 ms stream batching off): the chunks are
    # spread over the generation, not delivered in bursts. On this 2-core machine a starved engine frontend
    # can bunch one stream's chunks by itself (seen once in CI: 8 of 26 gaps over 5 ms), so up to three
    # streams are tried; a relay that batches bunches every one of them.
    for _ in range(3):
        stream = fleet.client().chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=32,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        arrivals, text = [], ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
                text += chunk.choices[0].delta.content
            assert chunk.usage is None  # not asked for, so not sent
        assert len(arrivals) >= 8 and text.strip()
        spread = arrivals[-1] - arrivals[0]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        if spread > 0.1 and sum(g > 0.005 for g in gaps) >= len(gaps) // 2:
            break
    assert spread > 0.1 and sum(g > 0.005 for g in gaps) >= len(gaps) // 2, gaps


def test_completion_streaming_with_usage(fleet):
    stream = fleet.client().completions.create(model="tiny", prompt="hello", max_tokens=12, stream=True,
                                               stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert sum(1 for c in chunks if c.choices) >= 2


def test_models_health_ready(fleet):
    ids = sorted(m.id for m in fleet.client().models.list().data)
    assert ids == ["smollm2", "tiny"]
    assert httpx.get(f"{fleet.base_url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{fleet.base_url}/ready")  # the bare status is open
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    assert "models" in fleet.admin("GET", "/ready").json()  # detail needs a key


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(model="smollm2", temperature=-1), openai.BadRequestError, "temperature"),
    (dict(model="smollm2", top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(model="smollm2", max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(model="smollm2", max_tokens=100_000), openai.BadRequestError, "2048"),
    (dict(model="deepseek-v9"), openai.NotFoundError, "Served models: smollm2, tiny"),
])
def test_bad_requests_get_clear_4xx(fleet, kwargs, exc, words):
    with pytest.raises(exc) as ei:
        fleet.client().chat.completions.create(messages=QUESTION, **kwargs)
    assert words in str(ei.value)


def test_prompt_plus_max_tokens_over_context_names_both_numbers(fleet):
    long_prompt = "word " * 1900
    with pytest.raises(openai.BadRequestError) as ei:
        fleet.client().completions.create(model="smollm2", prompt=long_prompt, max_tokens=500)
    msg = str(ei.value)
    assert "2048" in msg and "500" in msg


def test_malformed_json_and_auth(fleet):
    auth = {"authorization": f"Bearer {fleet.api_key}", "content-type": "application/json"}
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", content=b"{oops", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{fleet.base_url}/v1/chat/completions", json={"model": "smollm2", "messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        fleet.client(api_key="sk-wrong-key-0000").chat.completions.create(model="smollm2", messages=QUESTION)
    assert "sk-wrong-key-0000" not in fleet.log() and fleet.api_key not in fleet.log()


def test_metrics_count_requests_tokens_and_ttft(fleet):
    fleet.client().chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, stream=False)
    for _ in fleet.client().chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, stream=True):
        pass
    text = fleet.admin("GET", "/metrics").text
    assert 'lmfleet_requests_total{model="smollm2",served_by="local/smollm2",status="200"}' in text
    assert 'lmfleet_time_to_first_token_seconds_count{model="smollm2",served_by="local/smollm2"}' in text
    assert 'lmfleet_tokens_total{kind="output",model="smollm2",served_by="local/smollm2",usage_source="provider"}' in text
    assert 'lmfleet_errors_total{code="400",model="smollm2"}' in text
    assert 'lmfleet_model_ready{model="tiny"} 1.0' in text


def test_engine_queue_counts_reach_the_estimator(fleet):
    """vLLM's running/waiting gauges travel engine -> Ray metrics agent -> gateway poller -> /admin/state."""
    fleet.client().completions.create(model="tiny", prompt="hello", max_tokens=4)
    admin = {"authorization": f"Bearer {fleet.admin_key}"}
    deadline = time.monotonic() + 90  # Ray reports metrics every few seconds; the gateway reads every 5 s
    while True:
        models = httpx.get(f"{fleet.base_url}/admin/state", headers=admin).json()["models"]
        seen = {n: (m["engine_running"], m["engine_waiting"]) for n, m in models.items()}
        if all(r is not None and w is not None for r, w in seen.values()) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert all(r is not None and r >= 0 and w is not None and w >= 0 for r, w in seen.values()), seen
