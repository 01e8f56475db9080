"""Request anatomy: where a model's end-to-end time goes, from histogram sums taken before and after a window.

The model, per locally served request (means over the window)::

    e2e (gateway)  =  gateway  +  queue  +  prefill  +  decode  +  relay

    gateway   lmfleet_gateway_prepare_seconds: body, auth'd request validation, tokenizing, routing
    queue     vLLM's request_queue_time_seconds: waiting in the engine's scheduler
    prefill   vLLM's request_prefill_time_seconds: from scheduling to the first token
    decode    vLLM's request_decode_time_seconds: from the first token to the last
    relay     the rest: the hops gateway -> Serve's proxy -> replica -> engine and back, vLLM's own front end
              (tokenizing again, detokenizing), and relaying the stream to the client

**Ray's sums are approximations.** Ray 2.60's metrics path (OpenTelemetry, the default) rebuilds each histogram
from its bucket counts, recording every observation as its bucket's midpoint (ray issue 64852): a 1 ms queue wait
reads as 150 ms (vLLM's first queue bucket is 0-0.3 s). Counts are exact, sums are not, so on Ray the engine
phases are coarse and relay (a remainder) is unreliable; :func:`anatomy` says so in a note. Exact in any case,
from the gateway's own clock: ``gateway``, ``to_first_token`` (ttft - gateway: the hops, queue and prefill) and
``streaming`` (e2e - ttft: decode and relay). A bare vLLM server's ``vllm:`` histograms are exact.

The gateway's figures are per gateway process (a snapshot reads the process that answers it); vLLM's come from
every engine (Ray's metrics pages, summed over nodes and replicas) and include traffic that reached the engines
another way. Ray exports metrics every few seconds, so a window's engine figures settle a little after it ends
(:func:`engine_settled`). A histogram's (sum, count) pair is all we use: means, not percentiles.

Pure functions: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from lmfleet.provenance import local_label

__all__ = ["ENGINE_PHASES", "GATEWAY_PHASES", "Anatomy", "Snapshot", "Sums", "anatomies", "anatomy", "diff",
           "engine_settled", "engine_source", "engine_sums", "from_json", "gateway_sums", "render_table", "to_json"]

GATEWAY_PHASES: dict[str, str] = {
    "prepare": "lmfleet_gateway_prepare_seconds",
    "e2e": "lmfleet_request_latency_seconds",
    "ttft": "lmfleet_time_to_first_token_seconds",
}
"""Our phase name -> the gateway histogram it is read from (e2e and ttft: the locally served share only)."""

ENGINE_PHASES: dict[str, str] = {
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
    "inference": "request_inference_time_seconds",
    "e2e": "e2e_request_latency_seconds",
    "ttft": "time_to_first_token_seconds",
}
"""Our phase name -> vLLM's histogram (``vllm:NAME`` on a bare server, ``ray_vllm_NAME`` on Ray's pages)."""

_ENGINE_BY_NAME = {f"{prefix}{name}": phase for phase, name in ENGINE_PHASES.items()
                   for prefix in ("ray_vllm_", "vllm:")}
_ENGINE_PREFIXES = tuple(_ENGINE_BY_NAME)

Snapshot = dict[str, dict[str, "Sums"]]
"""model -> phase -> sums."""


@dataclass(frozen=True)
class Sums:
    """A histogram's running sum (seconds) and count."""

    sum: float = 0.0
    count: float = 0.0

    def __add__(self, o: "Sums") -> "Sums":
        return Sums(self.sum + o.sum, self.count + o.count)

    def __sub__(self, o: "Sums") -> "Sums":
        return Sums(self.sum - o.sum, self.count - o.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


def _add(out: dict[str, dict[str, Sums]], model: str, phase: str, sums: Sums) -> None:
    by_phase = out.setdefault(model, {})
    by_phase[phase] = by_phase.get(phase, Sums()) + sums


def gateway_sums(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> Snapshot:
    """Per model and phase, from the gateway registry's samples ``(name, labels, value)``.

    ``e2e`` and ``ttft`` count only requests served by the model's own engines (``served_by=local/MODEL``);
    ``prepare`` counts every request that got as far as a route.
    """
    names = {f"{metric}{suffix}": (phase, suffix) for phase, metric in GATEWAY_PHASES.items()
             for suffix in ("_sum", "_count")}
    out: dict[str, dict[str, Sums]] = {}
    for name, labels, value in samples:
        hit = names.get(name)
        model = labels.get("model")
        if hit is None or not model:
            continue
        phase, suffix = hit
        if phase != "prepare" and labels.get("served_by") != local_label(model):
            continue
        _add(out, model, phase, Sums(value, 0.0) if suffix == "_sum" else Sums(0.0, value))
    return out


def engine_sums(pages: Iterable[str]) -> Snapshot:
    """Per ``model_name`` and phase, summed over every engine on every page (Prometheus text: a Ray node's
    metrics page or a bare vLLM server's /metrics). Malformed pages and samples without a model are skipped."""
    out: dict[str, dict[str, Sums]] = {}
    for text in pages:
        lines = [ln for ln in text.splitlines() if ln.startswith(_ENGINE_PREFIXES)
                 and ("_sum" in ln.split("{", 1)[0] or "_count" in ln.split("{", 1)[0])]
        if not lines:
            continue
        try:
            families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
        except ValueError:
            continue
        for fam in families:
            for s in fam.samples:
                base, _, suffix = s.name.rpartition("_")
                phase = _ENGINE_BY_NAME.get(base)
                model = s.labels.get("model_name")
                if phase is None or not model or s.value != s.value or suffix not in ("sum", "count"):
                    continue
                _add(out, model, phase, Sums(s.value, 0.0) if suffix == "sum" else Sums(0.0, s.value))
    return out


def diff(after: Snapshot, before: Snapshot) -> Snapshot:
    """What happened between two snapshots (a counter that went backwards, e.g. a restarted engine, counts from 0)."""
    out: dict[str, dict[str, Sums]] = {}
    for model, phases in after.items():
        for phase, a in phases.items():
            b = before.get(model, {}).get(phase, Sums())
            d = a - b
            out.setdefault(model, {})[phase] = a if d.count < 0 or d.sum < 0 else d
    return out


def engine_settled(gateway: Snapshot, engine: Snapshot) -> bool:
    """Whether the engines' window counts have caught up with the gateway's (Ray exports every few seconds)."""
    for model, phases in gateway.items():
        served = phases.get("e2e", Sums()).count
        if served > 0 and engine.get(model, {}).get("e2e", Sums()).count < served:
            return False
    return True


@dataclass(frozen=True)
class Anatomy:
    """One model's split of its mean end-to-end time over a window (seconds; None: no figure)."""

    model: str
    requests: int
    """Requests the gateway saw served locally in the window."""
    engine_requests: int
    """Requests the engines finished in the window (other traffic included)."""
    e2e_s: float | None
    gateway_s: float | None
    queue_s: float | None
    prefill_s: float | None
    decode_s: float | None
    relay_s: float | None
    ttft_s: float | None
    engine_ttft_s: float | None
    notes: tuple[str, ...] = ()
    engine_approximate: bool = False
    """The engine phases are Ray's bucket-midpoint sums (see the module's docstring)."""

    @property
    def to_first_token_s(self) -> float | None:
        """From the end of the gateway phase to the first token at the gateway (exact)."""
        return self.ttft_s - self.gateway_s if self.ttft_s is not None and self.gateway_s is not None else None

    @property
    def streaming_s(self) -> float | None:
        """From the first token to the end of the answer at the gateway (exact; streamed requests)."""
        return self.e2e_s - self.ttft_s if self.e2e_s is not None and self.ttft_s is not None else None

    PHASES = ("gateway", "queue", "prefill", "decode", "relay")

    def phase_s(self, phase: str) -> float | None:
        return getattr(self, f"{phase}_s")

    def share(self, phase: str) -> float | None:
        """The phase's part of the end-to-end mean, in percent."""
        v = self.phase_s(phase)
        return 100.0 * v / self.e2e_s if v is not None and self.e2e_s else None

    def as_dict(self) -> dict[str, Any]:
        ms = (lambda v: round(v * 1000, 2) if v is not None else None)
        return {"model": self.model, "requests": self.requests, "engine_requests": self.engine_requests,
                "e2e_ms": ms(self.e2e_s), "ttft_ms": ms(self.ttft_s), "engine_ttft_ms": ms(self.engine_ttft_s),
                "phases_ms": {p: ms(self.phase_s(p)) for p in self.PHASES},
                "phases_pct": {p: round(s, 1) if (s := self.share(p)) is not None else None for p in self.PHASES},
                "exact_ms": {"gateway": ms(self.gateway_s), "to_first_token": ms(self.to_first_token_s),
                             "streaming": ms(self.streaming_s)},
                "engine_approximate": self.engine_approximate, "notes": list(self.notes)}


def anatomy(model: str, gateway: Mapping[str, Sums], engine: Mapping[str, Sums],
            engine_approximate: bool = False) -> Anatomy:
    """The split for one model from its window sums (``diff`` of two snapshots); ``engine_approximate``: the
    engine's sums are Ray's bucket midpoints."""
    g = lambda p: gateway.get(p, Sums())  # noqa: E731
    e = lambda p: engine.get(p, Sums())  # noqa: E731
    requests, engine_requests = int(g("e2e").count), int(e("e2e").count)
    e2e, prep = g("e2e").mean, g("prepare").mean
    queue, prefill, decode = e("queue").mean, e("prefill").mean, e("decode").mean
    notes: list[str] = []
    relay = None
    if e2e is not None and None not in (prep, queue, prefill, decode):
        relay = e2e - prep - queue - prefill - decode  # type: ignore[operator]
        if relay < 0 and engine_approximate:
            notes.append(f"the engine phases (Ray's bucket-midpoint approximations) add up to more than the "
                         f"gateway's end-to-end time by {-relay * 1000:.1f} ms; relay shown as 0. The exact "
                         f"split is gateway / to_first_token / streaming")
            relay = 0.0
        elif relay < 0:
            notes.append(f"the engine phases add up to more than the gateway's end-to-end time by "
                         f"{-relay * 1000:.1f} ms: the engines also served requests that did not pass this "
                         f"gateway process, or their metrics have not all been exported yet")
            relay = 0.0
    if requests == 0:
        notes.append("no locally served request in the window")
    elif engine_requests == 0:
        notes.append("no engine figures (Ray's metrics pages could not be read, or not exported yet)")
    elif engine_requests != requests:
        notes.append(f"the engines finished {engine_requests} requests, this gateway process saw {requests} "
                     "(other gateways, other clients, or requests still in flight at either end)")
    if engine_approximate and engine_requests and relay is not None and relay > 0:
        notes.append("queue/prefill/decode are Ray's bucket-midpoint approximations (coarse; relay is the remainder)")
    return Anatomy(model, requests, engine_requests, e2e, prep, queue, prefill, decode, relay, g("ttft").mean,
                   e("ttft").mean, tuple(notes), engine_approximate)


def anatomies(gateway: Snapshot, engine: Snapshot, engine_approximate: bool = False) -> list[Anatomy]:
    """One :class:`Anatomy` per model seen at either end, sorted by name."""
    return [anatomy(m, gateway.get(m, {}), engine.get(m, {}), engine_approximate)
            for m in sorted(set(gateway) | set(engine))]


def engine_source(pages: Iterable[str]) -> str | None:
    """``ray`` (approximate sums) when any page carries Ray's ``ray_vllm_`` histograms, ``vllm`` for a bare
    server's, None when neither."""
    found = None
    for text in pages:
        if "ray_vllm_request_queue_time_seconds" in text:
            return "ray"
        if "vllm:request_queue_time_seconds" in text:
            found = "vllm"
    return found


def render_table(rows: Iterable[Anatomy]) -> str:
    """A plain-text table: mean ms per phase and its share of end-to-end (``~``: Ray's approximate sums), then
    the exact gateway-side split (ttft, from the gateway phase to the first token, from the first token to the
    end)."""
    def cell(a: Anatomy, p: str) -> str:
        v, share = a.phase_s(p), a.share(p)
        if v is None:
            return "-"
        mark = "~" if a.engine_approximate and p != "gateway" else ""  # Ray's bucket midpoints
        return f"{mark}{v * 1000:.1f}" + (f" ({share:.0f}%)" if share is not None else "")

    ms = (lambda v: "-" if v is None else f"{v * 1000:.1f}")  # noqa: E731
    head = ["model", "requests", "e2e ms", *(f"{p} ms" for p in Anatomy.PHASES), "ttft ms", "to 1st tok ms",
            "streaming ms"]
    body = [[a.model, str(a.requests), ms(a.e2e_s), *(cell(a, p) for p in Anatomy.PHASES), ms(a.ttft_s),
             ms(a.to_first_token_s), ms(a.streaming_s)] for a in rows]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in body)])


def to_json(s: Snapshot) -> dict[str, dict[str, list[float]]]:
    """``{model: {phase: [sum, count]}}``: the wire form of a snapshot."""
    return {m: {p: [v.sum, v.count] for p, v in phases.items()} for m, phases in s.items()}


def from_json(data: Any) -> Snapshot:
    """The inverse of :func:`to_json`; malformed entries are skipped."""
    out: dict[str, dict[str, Sums]] = {}
    if not isinstance(data, dict):
        return out
    for m, phases in data.items():
        if not isinstance(phases, dict):
            continue
        for p, v in phases.items():
            if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
                out.setdefault(str(m), {})[str(p)] = Sums(float(v[0]), float(v[1]))
    return out
