"""The operator dashboard in headless Chromium against the real fleet (real CLI, Ray Serve, vLLM engines): the page
signs in with the admin key, shows every served model as ready with its replicas, draws its plots, and shows the
TTFT and throughput of requests sent while it watches."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from tests.unit.chromium import Browser
from tests.unit.test_gateway_dashboard import _chromium_or_skip

pytestmark = pytest.mark.e2e

_READ = """(() => {
  const out = {};
  document.querySelectorAll('.model[data-model]').forEach((card) => {
    const f = (n) => (card.querySelector('[data-field="' + n + '"]') || {}).textContent || '';
    const plots = {};
    card.querySelectorAll('[data-plot]').forEach((p) => {
      plots[p.dataset.plot] = p.querySelectorAll('polyline').length;
    });
    out[card.dataset.model] = {state: f('state'), replicas: f('replicas'), ttft: f('ttft'),
                               tokens_per_s: f('tokens_per_s'), in_flight_local: f('in_flight_local'),
                               queue: f('queue'), plots};
  });
  return {models: out, providers: document.getElementById('providers').textContent,
          html: document.documentElement.outerHTML, url: location.href};
})()"""


async def check_dashboard(base_url: str, admin_key: str, models: list[str], ask, streamed_model: str,
                          png: Path) -> dict:
    """Sign in, send a few streamed requests to ``streamed_model`` with ``ask()`` (blocking, run in a thread),
    wait for the page to show them; returns what the page showed. Shared with a one-model manual run."""
    async with Browser.start(_chromium_or_skip(), width=1280, height=900) as b:
        await b.navigate(f"{base_url}/dashboard#poll=500")
        await b.wait_for("!document.getElementById('login').hidden")
        await b.eval(f"document.getElementById('key').value = {admin_key!r};"
                     "document.getElementById('login-form').requestSubmit()")
        cards = " && ".join(f"document.querySelector('.model[data-model=\"{m}\"]') !== null" for m in models)
        await b.wait_for(cards, timeout_s=30)
        for _ in range(3):
            await asyncio.to_thread(ask)
        m = streamed_model
        # the window's TTFT and tokens/s show numbers, and the plots have lines
        await b.wait_for(f"""(() => {{ const c = document.querySelector('.model[data-model="{m}"]');
            return /\\d ms \\/ [\\d.,]+ ms/.test(c.querySelector('[data-field="ttft"]').textContent)
                && c.querySelectorAll('[data-plot="tokens"] polyline').length > 0; }})()""", timeout_s=60)
        seen = await b.eval(_READ)
        png.write_bytes(await b.screenshot())
        assert b.problems == [], b.problems
    for name in models:
        card = seen["models"][name]
        assert card["state"] == "ready", card
        assert re.match(r"[1-9]\d* · ", card["replicas"]), card  # running replicas, from Serve's status
        assert re.match(r"\d+ (\(.*\) )?/ \d+$", card["in_flight_local"]), card
        assert card["plots"]["in_flight"] > 0 and card["plots"]["queue"] > 0, card
    assert re.match(r"[\d.,]+ ms / [\d.,]+ ms", seen["models"][streamed_model]["ttft"])
    assert admin_key not in seen["html"] and admin_key not in seen["url"]
    return seen


async def test_dashboard_against_the_fleet(fleet, tmp_path):
    def ask():
        stream = fleet.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, stream=True)
        for _ in stream:
            pass

    png = Path(os.environ.get("LMFLEET_DASHBOARD_E2E_PNG", tmp_path / "dashboard.png"))
    seen = await check_dashboard(fleet.base_url, fleet.admin_key, fleet.models, ask, "smollm2", png)
    assert "backup" in seen["providers"]
