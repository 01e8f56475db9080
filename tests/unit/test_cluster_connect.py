"""One precedence for where Ray is: --address, RAY_ADDRESS, cluster.address, else none (a local head)."""

from __future__ import annotations

import socket

import pytest

from lmfleet.cluster.connect import LocalHead, check_reachable, connect, describe, resolve_ray_address, split_address
from lmfleet.config import parse_config


def fleet(address=None):
    cluster = {"address": address} if address else {}
    return parse_config({"cluster": cluster, "models": [{"name": "m", "source": "builtin:tiny-random"}]})


@pytest.mark.parametrize("cli, env, file, expected", [
    ("cli:6379", "env:6379", "file:6379", "cli:6379"),
    (None, "env:6379", "file:6379", "env:6379"),
    (None, None, "file:6379", "file:6379"),
    (None, None, None, None),
    ("", "  ", "file:6379", "file:6379"),  # empty values do not count
    (" cli:6379 ", None, None, "cli:6379"),
    ("auto", "env:6379", None, "auto"),
])
def test_resolve_ray_address(cli, env, file, expected):
    environ = {"RAY_ADDRESS": env} if env is not None else {}
    assert resolve_ray_address(cli, fleet(file), environ) == expected


def test_resolve_without_a_fleet():
    assert resolve_ray_address(None, None, {}) is None
    assert resolve_ray_address(None, None, {"RAY_ADDRESS": "h:1"}) == "h:1"


@pytest.mark.parametrize("address, local, text", [
    ("10.0.0.1:6379", None, "Ray cluster at 10.0.0.1:6379"),
    (None, LocalHead(num_cpus=2), "a local Ray head"),
    (None, None, "the Ray cluster running on this machine"),
])
def test_describe(address, local, text):
    assert describe(address, local) == text


def test_connect_starts_a_head_with_our_environment(monkeypatch):
    import ray

    from lmfleet.cluster import connect as mod

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("LMFLEET_TEST_FLAG", raising=False)
    assert mod.connect(None, local=LocalHead(num_cpus=3, env={"LMFLEET_TEST_FLAG": "1"})) is True
    import os

    assert os.environ["LMFLEET_TEST_FLAG"] == "1"
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 3 and calls[0]["include_dashboard"] is False
    monkeypatch.delenv("LMFLEET_TEST_FLAG")


def test_a_local_head_passes_env_vars_to_its_job_only(monkeypatch):
    """``env_vars`` reach the job's actors (runtime_env), not the head's own processes (its environment)."""
    import os

    import ray

    from lmfleet.cluster import connect as mod

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("LMFLEET_TEST_JOB_FLAG", raising=False)
    assert mod.connect(None, local=LocalHead(num_cpus=3), env_vars={"LMFLEET_TEST_JOB_FLAG": "1"}) is True
    assert calls[0]["runtime_env"] == {"env_vars": {"LMFLEET_TEST_JOB_FLAG": "1"}}
    assert "LMFLEET_TEST_JOB_FLAG" not in os.environ


@pytest.mark.parametrize("address, env_vars, expected_address, runtime_env", [
    ("h:6379", {"A": "1"}, "h:6379", {"env_vars": {"A": "1"}}),
    ("h:6379", None, "h:6379", None),
    (None, None, "auto", None),
])
def test_connect_joins(monkeypatch, address, env_vars, expected_address, runtime_env):
    import ray

    from lmfleet.cluster import connect as mod

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(mod, "check_reachable", lambda address: None)  # no head at h:6379
    assert mod.connect(address, env_vars=env_vars) is False
    assert calls[0]["address"] == expected_address
    assert calls[0].get("runtime_env") == runtime_env


@pytest.mark.parametrize(
    "address, expected",
    [
        ("10.0.0.1:6379", ("10.0.0.1", 6379)),
        ("head.example:6379", ("head.example", 6379)),
        ("[fd00::2]:6379", ("fd00::2", 6379)),
        ("auto", None),
        ("local", None),
        ("ray://head:10001", None),
        ("head", None),
        ("head:port", None),
        (":6379", None),
        ("", None),
    ],
)
def test_split_address(address, expected):
    assert split_address(address) == expected


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_reachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}")
    port = free_port()
    with pytest.raises(ConnectionError, match=f"no Ray cluster at 127.0.0.1:{port} .*--address"):
        check_reachable(f"127.0.0.1:{port}")
    check_reachable("auto")  # left to ray.init, which fails fast for it


def test_connect_to_an_address_where_nothing_listens_fails_before_ray_init(monkeypatch):
    """`serve`, `check` and `cluster status --address` with a dead head: one line in seconds, not ray.init's wait."""
    import ray

    def init(*a, **k):
        raise AssertionError("ray.init must not be reached")

    monkeypatch.setattr(ray, "init", init)
    port = free_port()
    with pytest.raises(ConnectionError, match=f"no Ray cluster at 127.0.0.1:{port}"):
        connect(f"127.0.0.1:{port}")


@pytest.mark.parametrize("argv, code", [
    (["cluster", "status"], 1),
    (["check", "-c", "examples/default.yaml"], 2),
    (["serve", "-c", "examples/default.yaml"], 1),
    (["apply", "-c", "examples/default.yaml", "--dry-run"], 1),
])
def test_commands_given_a_dead_head_address_fail_in_seconds(argv, code):
    """The real CLI: one line naming the address and the fix, its exit code, no traceback, no Ray started."""
    import subprocess
    import sys
    from pathlib import Path

    port = free_port()
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([str(Path(sys.executable).parent / "lmfleet"), *argv, "--address", f"127.0.0.1:{port}"],
                         cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stdout + out.stderr
    assert f"no Ray cluster at 127.0.0.1:{port} (Connection refused)" in out.stderr, out.stderr
    line = next(ln for ln in out.stderr.splitlines() if "no Ray cluster at" in ln)
    assert line.count(f"127.0.0.1:{port}") == 1, line  # said once, not again by the caller's prefix
    assert "Traceback" not in out.stderr
