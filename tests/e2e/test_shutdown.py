"""Ctrl-C on `lmfleet serve` stops everything it started: Ray, Serve replicas, vLLM engines, the gateway.
Runs after the other shared-fleet tests (``e2e_order(2)``): it stops the shared fleet."""

from __future__ import annotations

import signal
import socket

import pytest

from tests.e2e.conftest import alive, descendants, haproxies, haproxies_of, haproxy_node_dirs

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_order(2)]


def test_ctrl_c_leaves_no_process_behind(fleet):
    fleet.seen_pids.update(descendants(fleet.proc.pid))
    engines = [p for p in alive(fleet.seen_pids) if "EngineCore" in " ".join(p.cmdline())]
    assert engines, "expected running vLLM engines before shutdown"
    node_dirs = haproxy_node_dirs(haproxies(fleet.seen_pids))
    assert node_dirs, "expected Ray Serve's HAProxy (direct streaming is the default) before shutdown"
    fleet.proc.send_signal(signal.SIGINT)
    code = fleet.proc.wait(120)
    assert code in (0, 130), fleet.log()[-3000:]
    left = [(p.pid, " ".join(p.cmdline())[:80]) for p in alive(fleet.seen_pids)]
    assert left == [], left
    # also HAProxy processes that a reload during shutdown started after we last looked
    assert haproxies_of(node_dirs) == []
    port = int(fleet.base_url.rsplit(":", 1)[1])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert "lmfleet: stopped" in fleet.log()


def test_serve_proxy_switch_serves_through_serves_http_proxy(tmp_path):
    """gateway.serve_proxy: serve: no HAProxy; Serve's own proxy actor answers on serve_port. Runs after the
    shared fleet has stopped (one small engine: the tiny model)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import httpx
    import yaml

    from lmfleet.models import resolve_source
    from tests.e2e.conftest import _wait_http, end_processes, free_port, listening

    resolve_source("builtin:tiny-random")
    port, sport = free_port(), free_port()
    cfg = {"gateway": {"port": port, "serve_port": sport, "serve_proxy": "serve", "admin_key_env": None},
           "ledger": {"path": str(tmp_path / "ledger.sqlite")},
           "models": [{"name": "tiny", "source": "builtin:tiny-random",
                       "engine": {"max_model_len": 1024, "cpu_kvcache_space_gib": 1,
                                  # a shorter start; float32: eager bfloat16 kernels can die of SIGILL on AMX CPUs
                                  "enforce_eager": True, "dtype": "float32"}}]}
    config_path = tmp_path / "fleet.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}  # the fleet file must win
    proc = subprocess.Popen([str(Path(sys.executable).parent / "lmfleet"), "serve", "-c", str(config_path)],
                            env=env, cwd=tmp_path, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen: dict[int, float] = {}
    try:
        _wait_http(f"http://127.0.0.1:{port}/ready", proc, log, 600)
        seen.update(descendants(proc.pid))
        assert "Serve proxy" in log.read_text()
        assert haproxies(seen) == []
        socks = listening(alive(seen))
        assert [s for s in socks if s[1] == sport and s[0] == "127.0.0.1" and "Proxy" in s[2]], socks
        assert not [s for s in socks if 30000 <= s[1] <= 31000], socks  # no direct-ingress replica ports
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        # whole: events, then [DONE]; how many events carry the 8 tokens is vLLM's choice (its output collector
        # merges deltas a busy consumer has not read yet: 3 events in one loaded CI run, one per token when idle)
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2, lines
        import json

        events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) in (0, 130), log.read_text()[-3000:]
        assert alive(seen) == []
    finally:
        end_processes(proc, seen, signal.SIGINT)
