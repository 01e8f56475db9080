"""Ctrl-C on `lmfleet serve` stops everything it started: Ray, Serve replicas, vLLM engines, the gateway.
Runs last: it stops the shared fleet."""

from __future__ import annotations

import signal
import socket

import pytest

from tests.e2e.conftest import alive, descendants

pytestmark = pytest.mark.e2e


def test_ctrl_c_leaves_no_process_behind(fleet):
    fleet.seen_pids.update(descendants(fleet.proc.pid))
    engines = [p for p in alive(fleet.seen_pids) if "EngineCore" in " ".join(p.cmdline())]
    assert engines, "expected running vLLM engines before shutdown"
    fleet.proc.send_signal(signal.SIGINT)
    code = fleet.proc.wait(120)
    assert code in (0, 130), fleet.log()[-3000:]
    left = [(p.pid, " ".join(p.cmdline())[:80]) for p in alive(fleet.seen_pids)]
    assert left == [], left
    port = int(fleet.base_url.rsplit(":", 1)[1])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert "lmfleet: stopped" in fleet.log()
