"""`cluster join`: head address, labels, the `ray start` command line and where the token comes from."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lmfleet.cluster.join import JoinError, JoinSpec, auth_env, normalize_head_address, parse_labels, ray_start_argv


@pytest.mark.parametrize(
    ("given", "expected"),
    [("10.0.0.1", "10.0.0.1:6379"), ("10.0.0.1:7000", "10.0.0.1:7000"), ("head.lan", "head.lan:6379"),
     (" 10.0.0.1:6379 ", "10.0.0.1:6379")],
)
def test_normalize_head_address(given, expected):
    assert normalize_head_address(given) == expected


@pytest.mark.parametrize("bad", ["", "ray://10.0.0.1:10001", "10.0.0.1:", "10.0.0.1:99999", ":6379", "h:p"])
def test_bad_head_address(bad):
    with pytest.raises(JoinError, match="head address"):
        normalize_head_address(bad)


@pytest.mark.parametrize(
    ("items", "expected", "error"),
    [([], {}, None), (["zone=a", "gpu=h100"], {"zone": "a", "gpu": "h100"}, None), (["k="], {"k": ""}, None),
     (["novalue"], None, "'novalue'"), (["=v"], None, "'=v'"), (["a=b,c=d"], None, "without commas")],
)
def test_parse_labels(items, expected, error):
    if error:
        with pytest.raises(JoinError, match=error):
            parse_labels(items)
    else:
        assert parse_labels(items) == expected


def test_ray_start_argv():
    spec = JoinSpec("10.0.0.1:6379", num_cpus=4, num_gpus=1, labels={"z": "a", "b": "c"},
                    node_ip_address="10.0.0.9", temp_dir="/tmp/r", block=True)
    assert ray_start_argv(spec, "/venv/bin/ray") == [
        "/venv/bin/ray", "start", "--address=10.0.0.1:6379", "--disable-usage-stats", "--node-ip-address=10.0.0.9",
        "--num-cpus=4", "--num-gpus=1", "--labels=b=c,z=a", "--temp-dir=/tmp/r", "--block"]
    assert ray_start_argv(JoinSpec("h:1")) == ["ray", "start", "--address=h:1", "--disable-usage-stats"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def _token(path, text="tok-123"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_token_sources_in_order(home):
    f = _token(home / "given")
    assert auth_env({}, str(f)) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(f)}
    assert auth_env({"RAY_AUTH_TOKEN": "x"}, None) == {"RAY_AUTH_MODE": "token"}
    p = _token(home / "p")
    assert auth_env({"RAY_AUTH_TOKEN_PATH": str(p)}, None)["RAY_AUTH_TOKEN_PATH"] == str(p)
    d = _token(home / ".ray" / "auth_token")
    assert auth_env({}, None)["RAY_AUTH_TOKEN_PATH"] == str(d)
    assert auth_env({}, None, auth=False) == {"RAY_AUTH_MODE": "disabled"}


@pytest.mark.parametrize(
    ("env", "token_file", "message"),
    [({}, None, "no Ray auth token found"), ({}, "/nonexistent/tok", "does not exist"),
     ({"RAY_AUTH_TOKEN_PATH": "/nonexistent/t"}, None, "RAY_AUTH_TOKEN_PATH")],
)
def test_token_missing_is_explained(home, env, token_file, message):
    with pytest.raises(JoinError, match=message):
        auth_env(env, token_file)


def test_empty_token_file(home):
    with pytest.raises(JoinError, match="is empty"):
        auth_env({}, str(_token(home / "t", "  \n")))


def test_cli_join_print_never_shows_the_token(home):
    from lmfleet.cli.main import app

    f = _token(home / "tok", "very-secret-token")
    r = CliRunner().invoke(app, ["cluster", "join", "10.0.0.1", "--token-file", str(f), "--num-gpus", "2",
                                 "--label", "zone=a", "--print"])
    assert r.exit_code == 0, r.output
    assert "very-secret-token" not in r.output
    assert f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={f}" in r.output
    assert "start --address=10.0.0.1:6379 --disable-usage-stats --num-gpus=2 --labels=zone=a" in r.output


def test_cli_join_without_token_exits_2(home):
    from lmfleet.cli.main import app

    r = CliRunner().invoke(app, ["cluster", "join", "10.0.0.1", "--print"])
    assert r.exit_code == 2 and "no Ray auth token found" in r.output
