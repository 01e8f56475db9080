"""Tenants on the real fleet (issue 14): a batch tenant floods while an interactive tenant is served.

Tenants (tests/e2e/conftest.py): ``tenant-a`` (class ``batch``, ``max_concurrency: 4``, may not pay for
providers), ``tenant-b`` (``interactive``), and the flat key as ``default`` (unlimited, interactive).

A's flood is 12 workers against its concurrency limit of 4, in a process of its own (lmfleet/testing/flood.py); a
refused worker waits for retry-after, as the OpenAI client does. The test asserts what holds on any machine: A is
refused beyond its limit with OpenAI's rate-limit headers, B is never refused and is served while A floods, A's
batch never reaches the paid provider, and the ledger attributes every answered request. How much the flood
slows B (the P99 TTFT ratio) depends on the machine's cores: ``benchmarks/bench_tenants.py --fleet-url`` measures it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time

import httpx
import pytest

from tests.e2e.conftest import TENANT_A_KEY, TENANT_B_KEY, VENV_BIN
from lmfleet.testing.flood import Flood, trickle

pytestmark = pytest.mark.e2e

MODEL = "tiny"  # cheapest engine; overflow is off for it
FLOOD_WORKERS = 12  # 3x tenant-a's max_concurrency (4, conftest.py)
FLOOD_TOKENS = 256  # answers long enough that the niced flood's requests overlap (tiny answers 32 tokens in ~25 ms)
B_REQUESTS = 20  # B's requests while A floods
FLOOD_WAIT_S = 90  # at most this long for A's flood to be refused once before B's requests start
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


def _headers_ok(headers: dict[str, str], body: dict) -> None:
    assert int(headers["retry-after"]) >= 1
    for h in RATE_HEADERS:
        assert h in headers, (h, sorted(headers))
    assert headers["x-ratelimit-limit-requests"] == "100000" and headers["x-ratelimit-limit-tokens"] == "10000000"
    assert 0 <= int(headers["x-ratelimit-remaining-requests"]) <= 100000
    assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) <= 10000000
    assert headers["x-ratelimit-reset-requests"][-1] == "s"  # OpenAI's duration format: 250ms, 6s, 1m30s
    assert body["error"]["code"] == "concurrency_limit_exceeded" and "tenant-a" in body["error"]["message"]
    assert headers.get("x-lmfleet-priority") == "batch"


def _usage(fleet) -> tuple[dict[str, int], dict[str, int]]:
    """Requests per tenant from /admin/usage (which flushes the gateway's pending rows first) and from the real
    CLI reading the ledger after it."""
    r = fleet.admin("GET", "/admin/usage", params={"by": "tenant"})
    assert r.status_code == 200, r.text
    out = subprocess.run([str(VENV_BIN / "lmfleet"), "usage", "-c", str(fleet.config_path), "--by", "tenant",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cli = {row["tenant"]: row["requests"] for row in json.loads(out.stdout)["rows"]}
    api = {row["tenant"]: row["requests"] for row in r.json()["rows"]}
    return api, cli


def _usage_by_tenant(fleet) -> dict[str, int]:
    api, cli = _usage(fleet)
    assert cli == api
    return cli


def _until_attributed(fleet, before: dict[str, int], want: dict[str, int], timeout_s: float = 60.0) -> None:
    """The ledger's requests per tenant, through the API and the CLI, reach ``before + want``. /admin/usage waits
    at most 5 s for pending rows: on a loaded 2-core machine the last rows of a flood can take longer."""
    deadline = time.monotonic() + timeout_s
    while True:
        api, cli = _usage(fleet)
        got = [{t: d.get(t, 0) - before.get(t, 0) for t in want} for d in (api, cli)]
        if got == [want, want] or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert got == [want, want]


def test_batch_flood_is_limited_while_interactive_is_served_and_stays_off_the_paid_provider(fleet):
    before = _usage_by_tenant(fleet)
    a_ok = b_ok = 0
    # B's requests start once A's flood holds more than its limit (a process at nice 19 on a loaded 2-core machine
    # can take seconds to have its 12 requests in flight)
    flood = Flood(fleet.base_url, TENANT_A_KEY, MODEL, FLOOD_WORKERS, FLOOD_TOKENS, until_refused_s=FLOOD_WAIT_S)
    with httpx.Client(base_url=fleet.base_url, headers={"authorization": f"Bearer {TENANT_B_KEY}"},
                      timeout=120) as b:
        solo, s = trickle(b, MODEL, 3)
        b_statuses = list(s)
        flood.start()
        flooded, s = trickle(b, MODEL, B_REQUESTS)
        flood.stop()
        b_statuses += s
    b_ok += b_statuses.count(200)
    a_ok += flood.ok

    # the same flood from the unlimited interactive default tenant: reported, and counted in the ledger check
    control = Flood(fleet.base_url, fleet.api_key, MODEL, FLOOD_WORKERS, FLOOD_TOKENS)
    with httpx.Client(base_url=fleet.base_url, headers={"authorization": f"Bearer {TENANT_B_KEY}"},
                      timeout=120) as b:
        control.start()
        _, s = trickle(b, MODEL, 3)
        control.stop()
    b_ok += s.count(200)
    print(f"\nB TTFT ms: solo p50 {statistics.median(solo) * 1e3:.1f} (n={len(solo)}); A flooding p50 "
          f"{statistics.median(flooded) * 1e3:.1f} max {max(flooded) * 1e3:.1f} (n={len(flooded)}); A ok {flood.ok} "
          f"429 {flood.refused} other {flood.other}; default ok {control.ok} 429 {control.refused}")

    assert set(b_statuses) == {200}, b_statuses  # B never refused
    assert len(flooded) == B_REQUESTS  # and served while A floods
    # A served up to its limit, refused beyond it
    assert flood.refused_at_start, f"A's flood was not refused within {FLOOD_WAIT_S} s of its start"
    assert flood.ok > 0 and flood.refused > 0 and not flood.other, (flood.ok, flood.refused, flood.other)
    for headers, body in flood.refusals:
        _headers_ok(headers, body)

    # batch from A never reaches the paid provider, even while every interactive request overflows
    fleet.proxy.set_fault(mode="none")
    start = fleet.proxy.stats_dict()["requests"]
    assert fleet.admin("POST", "/admin/overflow", json={"model": "smollm2", "mode": "force_on"}).status_code == 200
    try:
        with httpx.Client(base_url=fleet.base_url, timeout=120) as c:
            for _ in range(3):
                r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {TENANT_A_KEY}"},
                           json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
                assert r.status_code == 200, r.text
                assert r.headers["x-lmfleet-served-by"] != "provider/backup"
                a_ok += 1
            assert fleet.proxy.stats_dict()["requests"] == start
            r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {TENANT_B_KEY}"},
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            b_ok += r.status_code == 200
            # interactive does overflow
            assert r.headers.get("x-lmfleet-served-by") == "provider/backup", (r.status_code, dict(r.headers))
    finally:
        fleet.admin("POST", "/admin/overflow", json={"model": "smollm2", "mode": "auto"})
    assert fleet.proxy.stats_dict()["requests"] > start

    # the ledger attributes every answered request (refusals before a backend write no row)
    _until_attributed(fleet, before, {"tenant-a": a_ok, "tenant-b": b_ok, "default": control.ok})


def test_a_limit_changed_through_the_admin_api_holds_at_once_with_openai_headers(fleet):
    """``PUT /admin/tenants/tenant-a`` on the real gateway: requests per minute down to 1 (A has used more in the
    last minute, or uses one now) -> 429 ``requests`` with remaining 0; ``DELETE`` -> fleet.yaml's limits again."""
    headers = {"authorization": f"Bearer {TENANT_A_KEY}"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    httpx.post(f"{fleet.base_url}/v1/completions", json=body, headers=headers, timeout=120)
    r = fleet.admin("PUT", "/admin/tenants/tenant-a", json={"limits": {"requests_per_minute": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["limits"] == {"requests_per_minute": 1, "tokens_per_minute": 10000000, "max_concurrency": 4,
                                  "hourly_usd": None, "daily_usd": None}
    assert r.json()["persisted"] is True and TENANT_A_KEY not in r.text
    try:
        r = httpx.post(f"{fleet.base_url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 429, r.text
        assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("requests", "rate_limit_exceeded")
        assert r.headers["x-ratelimit-limit-requests"] == "1" and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-tokens"] == "10000000" and "x-ratelimit-reset-tokens" in r.headers
        assert fleet.admin("GET", "/admin/tenants").json()["tenants"]["tenant-a"]["source"] == "admin"
    finally:
        assert fleet.admin("DELETE", "/admin/tenants/tenant-a").status_code == 200
    r = httpx.post(f"{fleet.base_url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100000"
