"""An engine that dies: its model answers 503 with a clear message and /ready turns false, while the
other models keep serving. Runs after the other fleet tests (``e2e_order(1)``): it breaks the shared fleet's `tiny` model (Serve restarts it)."""

from __future__ import annotations

import time

import openai
import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_order(1)]


def _engine_of(fleet, model: str) -> psutil.Process:
    for p in psutil.Process(fleet.proc.pid).children(recursive=True):
        try:
            if f"LLMServer:{model}" in " ".join(p.cmdline()):
                for c in p.children(recursive=True):
                    if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name():
                        return c
        except psutil.Error:
            continue
    raise AssertionError(f"no vLLM engine process found for {model}")


def test_dead_engine_gives_503_and_not_ready_while_others_serve(fleet):
    c = fleet.client(timeout=60)
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    engine = _engine_of(fleet, "tiny")
    engine.kill()
    engine.wait(10)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as ei:
        for _ in range(5):  # Serve may still route to the dying replica for a moment
            c.completions.create(model="tiny", prompt="hi", max_tokens=2)
            time.sleep(1)
    assert ei.value.status_code == 503, ei.value
    assert "tiny" in ei.value.message and "unavailable" in ei.value.message
    assert time.monotonic() - t0 < 60
    ready = fleet.admin("GET", "/ready").json()
    assert ready["ready"] is False and ready["models"]["tiny"]["ready"] is False
    assert ready["models"]["smollm2"]["ready"] is True
    r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi"}], max_tokens=4)
    assert r.choices[0].message.content is not None
