"""Cost per provider: from the gateway's usage ledger when it has one, else from ``--price`` flags.

Ledger: ``GET {base_url}/admin/usage?since=<unix_ts>`` (optional; 404 or any failure means "no ledger").
Accepted shapes (the first that matches wins)::

    {"by_provider": {"local/smollm2": {"cost_usd": 0.1, "input_tokens": 10, "output_tokens": 20}, ...}}
    {"providers": {...same...}}
    {"rows" | "usage" | "items": [{"provider": "...", "cost_usd": ..., "input_tokens": ..., "output_tokens": ...}]}
    [{"provider": ..., ...}, ...]

``served_by`` is accepted for ``provider`` (lmfleet's gateway answers ``{"rows": [{"served_by": ...}], "total": ...}``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from lmfleet.bench.workload import BenchInputError


@dataclass(frozen=True)
class Price:
    """USD per 1M tokens."""

    input_per_m: float
    output_per_m: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_m + output_tokens * self.output_per_m) / 1e6


def parse_price(text: str) -> tuple[str, Price]:
    """``KEY=IN:OUT`` e.g. ``local=0.05:0.10`` or ``provider/x=0.5:1.5`` (USD per 1M input:output tokens)."""
    key, sep, value = text.partition("=")
    parts = value.split(":")
    try:
        if not sep or not key or len(parts) != 2:
            raise ValueError
        price = Price(float(parts[0]), float(parts[1]))
    except ValueError:
        raise BenchInputError(f"--price {text!r}: expected KEY=INPUT_USD:OUTPUT_USD per 1M tokens, "
                              "e.g. local=0.05:0.10 or provider/x=0.5:1.5") from None
    if price.input_per_m < 0 or price.output_per_m < 0:
        raise BenchInputError(f"--price {text!r}: prices must be >= 0")
    return key, price


def price_for(provider: str, prices: dict[str, Price]) -> Price | None:
    """Exact provider name, then its prefix before '/' (``local`` matches ``local/smollm2``), then ``*``."""
    for key in (provider, provider.split("/", 1)[0], "*"):
        if key in prices:
            return prices[key]
    return None


def costs_from_prices(tokens: dict[str, tuple[int, int]], prices: dict[str, Price]) -> dict[str, float | None]:
    """Provider -> USD for its (input, output) tokens; ``None`` where no price applies."""
    out: dict[str, float | None] = {}
    for provider, (n_in, n_out) in tokens.items():
        p = price_for(provider, prices)
        out[provider] = p.cost(n_in, n_out) if p else None
    return out


def per_million_output(cost_usd: float | None, output_tokens: int) -> float | None:
    if cost_usd is None or output_tokens <= 0:
        return None
    return cost_usd / output_tokens * 1e6


def parse_usage(data: Any) -> dict[str, dict[str, float]] | None:
    """Normalise a ledger answer to ``{provider: {cost_usd, input_tokens, output_tokens}}``; None if unknown."""
    rows: list[dict] | None = None
    if isinstance(data, dict):
        for key in ("by_provider", "providers"):
            if isinstance(data.get(key), dict):
                rows = [{"provider": k, **v} for k, v in data[key].items() if isinstance(v, dict)]
                break
        else:
            for key in ("rows", "usage", "items"):
                if isinstance(data.get(key), list):
                    rows = data[key]
                    break
    elif isinstance(data, list):
        rows = data
    if rows is None:
        return None
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        name = row.get("provider", row.get("served_by")) if isinstance(row, dict) else None
        if name is None:
            continue
        agg = out.setdefault(str(name), {"cost_usd": 0.0, "input_tokens": 0, "output_tokens": 0})
        agg["cost_usd"] += float(row.get("cost_usd") or row.get("cost") or 0.0)
        agg["input_tokens"] += int(row.get("input_tokens") or row.get("prompt_tokens") or 0)
        agg["output_tokens"] += int(row.get("output_tokens") or row.get("completion_tokens") or 0)
    return out or None


def fetch_usage(base_url: str, since: float, admin_key: str | None, timeout: float = 10.0) -> dict | None:
    """The gateway ledger since ``since``, or None (no endpoint, not lmfleet, unreadable)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        r = httpx.get(f"{base_url.rstrip('/')}/admin/usage", params={"since": since}, headers=headers,
                      timeout=timeout)
        if r.status_code != 200:
            return None
        return parse_usage(r.json())
    except (httpx.HTTPError, ValueError):
        return None


LEDGER_WAIT_S = 5.0
"""How long :func:`usage_covering` waits for the ledger to show every backend that answered."""


def usage_covering(fetch: Callable[[], dict | None], served: set[str], wait_s: float = LEDGER_WAIT_S,
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> dict | None:
    """The gateway's usage (``fetch``: :func:`fetch_usage`) once it has a row for every backend in ``served`` (the
    ``x-lmfleet-served-by`` of the answers): a gateway writes a stream's ledger row just after its last event, so
    a client that asks at once can be ahead of the last row. At most ``wait_s``, then what the ledger has (the
    backends it lacks are priced instead); None: no ledger."""
    deadline = clock() + wait_s
    usage = fetch()
    while usage is not None and not served <= usage.keys() and clock() < deadline:
        sleep(0.2)
        usage = fetch()
    return usage


def cost_table(tokens: dict[str, tuple[int, int]], prices: dict[str, Price],
               ledger: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    """Per provider and overall: cost and $/1M output tokens, with where the figure came from."""
    rows: dict[str, dict[str, Any]] = {}
    priced = costs_from_prices(tokens, prices)
    for provider, (n_in, n_out) in tokens.items():
        if ledger and provider in ledger:
            cost, source = ledger[provider]["cost_usd"], "ledger"
        elif priced[provider] is not None:
            cost, source = priced[provider], "price"
        else:
            cost, source = None, "none"
        rows[provider] = {"cost_usd": cost, "source": source,
                          "usd_per_1m_output": per_million_output(cost, n_out)}
    known = [r["cost_usd"] for r in rows.values() if r["cost_usd"] is not None]
    total_out = sum(o for p, (_, o) in tokens.items() if rows[p]["cost_usd"] is not None)
    all_known = bool(rows) and len(known) == len(rows)
    total = sum(known) if known else None
    return {
        "providers": rows,
        "overall": {"cost_usd": total, "usd_per_1m_output": per_million_output(total, total_out),
                    "complete": all_known},
    }
