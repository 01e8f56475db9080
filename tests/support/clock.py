"""Test helpers for the gateway's load tracker."""


def freeze_tracker_clock(tracker, monkeypatch, at: float = 1000.0) -> None:
    """Stop ``tracker``'s clock: no busy time passes, so while nothing completes the estimate keeps the cold drain
    rate exactly (with time passing and no completion, the rate it counts on falls: ``estimator.drain_rate``)."""
    monkeypatch.setattr(tracker, "_clock", lambda: at)
