"""What the gateway knew when it predicted a request's local wait: the estimate's inputs, kept for learning.

For every request it keeps or sends local, the route records the :class:`QueueSignals` that fed the estimate (after
leaving out the requests queued behind it in less urgent classes), the request's prompt tokens, the model's capacity,
its class order, the estimate, the miss margin and the threshold. The ledger stores it as JSON in the ``admission``
column beside ``predicted_wait_ms`` and ``realised_wait_ms``; ``/admin/usage?estimate=1&features=1`` reads it back,
and :mod:`lmfleet.overflow.estimators` fits and compares wait estimators on those rows (chosen leave-one-trace-out
by ``benchmarks/estimator_loto.py``).

The route builds the :class:`Admission` (a frozen dataclass: no work beyond the object); the JSON is written by the
ledger's writer, off the event loop (:func:`admission_json`). The JSON is ``dataclasses.asdict`` of it::

    {"signals": {"in_flight": 9, "drain_rps": 1.8, ...}, "capacity": 8, "prompt_tokens": 512, "order": null,
     "estimate_ms": 1840.0, "margin_ms": 750.0, "applied_margin_ms": 750.0, "threshold_ms": 2500.0}
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lmfleet.overflow.signals import QueueSignals

__all__ = ["Admission", "admission_json", "admission_rows", "parse_admission"]


@dataclass(frozen=True)
class Admission:
    """One request's estimate and what it was computed from (module docstring)."""

    signals: QueueSignals
    """The load the estimate saw (requests waiting in a less urgent class already left out of ``in_flight``)."""
    capacity: int
    """Concurrent requests the local engines run (``local_capacity``)."""
    prompt_tokens: int
    order: int | None
    """The request's priority class order (None: no class)."""
    estimate_ms: float
    """The predicted wait (``predicted_wait_ms``)."""
    margin_ms: float
    """The miss margin (learned, or its prior) when the request arrived."""
    applied_margin_ms: float
    """What the route added to the estimate before comparing it with the threshold (0 below the margin's band)."""
    threshold_ms: float


def admission_json(admission: Admission | Mapping[str, Any] | None) -> str | None:
    """The ledger's ``admission`` text: an :class:`Admission`, or its ``dataclasses.asdict`` form, as compact JSON."""
    if admission is None:
        return None
    if isinstance(admission, Admission):  # asdict's result, without its deep copy (a few times slower)
        admission = {**vars(admission), "signals": vars(admission.signals)}
    return json.dumps(admission, separators=(",", ":"))


_SIGNAL_FIELDS = frozenset(f.name for f in dataclasses.fields(QueueSignals))
_FIELDS = frozenset(f.name for f in dataclasses.fields(Admission)) - {"signals"}


def parse_admission(value: str | Mapping[str, Any]) -> Admission:
    """An :class:`Admission` back from the ledger's JSON (or its parsed dict); keys it does not know are ignored, so
    rows written by a newer gateway still read. Raises ``ValueError`` on text that is not such an object."""
    d = json.loads(value) if isinstance(value, str) else value
    if not isinstance(d, Mapping) or not isinstance(d.get("signals"), Mapping):
        raise ValueError(f"not an admission record: {str(value)[:200]!r}")
    fields = {k: v for k, v in d["signals"].items() if k in _SIGNAL_FIELDS}
    if isinstance(fields.get("gate_queue"), list):  # JSON has no tuples
        fields["gate_queue"] = tuple(tuple(q) for q in fields["gate_queue"])
    signals = QueueSignals(**fields)
    return Admission(signals=signals, **{k: v for k, v in d.items() if k in _FIELDS})


def admission_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ledger rows (``Ledger.rows()``) of requests with an estimate and an admission record, in the form the
    candidates read and ``/admin/usage?estimate=1&features=1`` returns: ts, model, served_by, status, tenant,
    ``predicted_wait_ms``, ``realised_wait_ms`` (None: no first token timed) and ``admission`` (a dict)."""
    out = []
    for r in rows:
        a = r.get("admission")
        if a is None or r.get("predicted_wait_ms") is None:
            continue
        keep = {k: r.get(k) for k in ("ts", "model", "served_by", "status", "tenant", "predicted_wait_ms",
                                      "realised_wait_ms")}
        out.append(keep | {"admission": json.loads(a) if isinstance(a, str) else a})
    return out
