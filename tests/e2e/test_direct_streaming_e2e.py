"""Direct streaming (gateway.serve_proxy: haproxy, the default) on the shared fleet: HAProxy answers on
serve_port, replica ports stay on loopback, and a streamed answer arrives chunk by chunk and whole."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import yaml

from tests.e2e.conftest import descendants, haproxies, listening

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_TOKENS = 16


def _serve_port(fleet) -> int:
    return int(yaml.safe_load(fleet.config_path.read_text())["gateway"]["serve_port"])


def test_haproxy_fronts_serve_and_replicas_listen_on_loopback(fleet):
    assert "HAProxy (direct streaming)" in fleet.log()
    fleet.seen_pids.update(descendants(fleet.proc.pid))
    procs = haproxies(fleet.seen_pids)
    assert procs, "expected an HAProxy process under `lmfleet serve`"
    serve_port = _serve_port(fleet)
    assert ("127.0.0.1", serve_port, "haproxy") in listening(procs), listening(procs)
    # replica HTTP ports (Ray's direct-ingress range) of a local head listen on loopback only
    from tests.e2e.conftest import alive

    replica_socks = [s for s in listening(alive(fleet.seen_pids)) if 30000 <= s[1] <= 31000]
    assert replica_socks, "expected replica HTTP ports in 30000-31000"
    assert {ip for ip, _, _ in replica_socks} == {"127.0.0.1"}, replica_socks


def _stream(fleet) -> tuple[list[str], list[float], bool]:
    body = {"model": fleet.models[0], "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    texts, arrivals, done = [], [], False
    with httpx.stream("POST", f"{fleet.base_url}/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {fleet.api_key}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            if chunk.get("choices"):
                texts.append(chunk["choices"][0]["text"])
                arrivals.append(time.monotonic())
    return texts, arrivals, done


def test_streamed_answer_through_direct_path_arrives_chunk_by_chunk_and_whole(fleet):
    whole = fleet.client().completions.create(model=fleet.models[0], prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
    expected = whole.choices[0].text
    # a busy 2-core machine can bunch one stream's chunks (CI once bunched three tries in a row right after the
    # browser test); a relay that buffers bunches every try
    for attempt in range(5):
        if attempt:
            time.sleep(1.0)
        texts, arrivals, done = _stream(fleet)
        assert done, "stream did not end with [DONE]"
        assert "".join(texts) == expected
        assert len(texts) >= MAX_TOKENS, texts
        spread = [b - a for a, b in zip(arrivals, arrivals[1:])]
        if sum(g > 0.002 for g in spread) >= MAX_TOKENS // 2:
            return
    pytest.fail(f"chunks arrived bunched: gaps {[round(g * 1000, 1) for g in spread]} ms")
