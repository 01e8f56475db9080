"""The "ready in …" line and lmfleet's one-line terminal warnings."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lmfleet.cli.terminal import terminal_line
from lmfleet.serve.timing import Phases, ready_line


@pytest.mark.parametrize("total, phases, expected", [
    (74.2, [("model", 12.4), ("Ray", 6.0), ("engines", 51.0)], "lmfleet: ready in 74 s: model 12 s, Ray 6 s, engines 51 s"),
    (9.6, [("start", 0.2), ("model", 0.4), ("Ray", 3.0)], "lmfleet: ready in 10 s: Ray 3 s"),  # under 0.5 s: left out
    (0.3, [], "lmfleet: ready in 0 s"),
])
def test_ready_line(total, phases, expected):
    assert ready_line(total, phases) == expected


def test_phases_add_up_per_name_in_first_seen_order():
    p = Phases(origin=0.0)
    p.add("Serve", 2.0)
    p.add("engines", 40.0)
    p.add("Serve", 1.0)
    assert [n for n, _ in p.done] == ["start", "Serve", "engines"]
    assert dict(p.done)["Serve"] == 3.0


@pytest.mark.parametrize("level, msg, log, expected", [
    (logging.WARNING, "queue full", Path("s.log"), "lmfleet: warning: queue full"),
    # no stack on the terminal: the first line, and where the rest is
    (logging.ERROR, "engine died\n  File x.py, line 3", Path("s.log"), "lmfleet: error: engine died (details in s.log)"),
    (logging.ERROR, "engine died\n  File x.py, line 3", None, "lmfleet: error: engine died"),
    (logging.WARNING, "  \n", None, "lmfleet: warning: "),
])
def test_terminal_line_is_one_line(level, msg, log, expected):
    rec = logging.LogRecord("lmfleet.x", level, __file__, 1, msg, None, None)
    assert terminal_line(rec, log) == expected
