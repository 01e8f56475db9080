"""`lmfleet profile`'s client side: the run against a fake gateway (httpx.MockTransport), the CLI's refusals, and
the engine's profiler settings built from the fleet file."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from lmfleet.cli.main import app
from lmfleet.config import ConfigError, parse_config
from lmfleet.engine.app import llm_config_kwargs, profiler_trace_dir
from lmfleet.profile.client import LoadSpec, ProfileClient, ProfileError, run_profile

SESSION = "20261201T100000Z-abcdef"


def snap(n: int, engine_n: int) -> dict:
    """Cumulative sums after ``n`` gateway requests of 100 ms (1 ms gateway) and ``engine_n`` engine requests."""
    return {"at": 0, "pid": 7, "engine_error": None,
            "gateway": {"m": {"e2e": [0.1 * n, n], "prepare": [0.001 * n, n], "ttft": [0.05 * n, n]}},
            "engine": {"m": {"queue": [0.01 * engine_n, engine_n], "prefill": [0.02 * engine_n, engine_n],
                             "decode": [0.05 * engine_n, engine_n], "e2e": [0.08 * engine_n, engine_n]}}}


class FakeGateway:
    """Answers the admin API from a list of snapshots (the engines catch up one snapshot late)."""

    def __init__(self, snaps: list[dict], start_status: int = 200):
        self.snaps = snaps
        self.calls: list[tuple[str, str, dict | None]] = []
        self.start_status = start_status

    def __call__(self, req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content) if req.content else None
        self.calls.append((req.method, req.url.path, body))
        assert req.headers["authorization"] == "Bearer adm"
        if req.url.path == "/admin/profile/snapshot":
            return httpx.Response(200, json=self.snaps.pop(0) if len(self.snaps) > 1 else self.snaps[0])
        if req.url.path == "/admin/profile/start":
            if self.start_status != 200:
                return httpx.Response(self.start_status, json={"error": {"message": "No model has no engine.profiler_dir"}})
            return httpx.Response(200, json={"session": SESSION, "started_at": 0,
                                             "models": {"m": {"replicas": 1, "dir": "/p/m"}}})
        if req.url.path == "/admin/profile/stop":
            return httpx.Response(200, json={"session": SESSION, "models": {"m": {"replicas": 1}}, "skipped": [],
                                             "errors": [], "files": [{"model": "m", "node": "n1", "name": "t.gz",
                                                                      "bytes": 3}]})
        if req.url.path == f"/admin/profile/files/{SESSION}/m/n1/t.gz":
            return httpx.Response(200, content=b"abc")
        return httpx.Response(404, json={"error": {"message": "Not found."}})


def client(fake: FakeGateway) -> ProfileClient:
    return ProfileClient("http://gw", "adm", transport=httpx.MockTransport(fake))


def test_live_window_waits_for_the_engines_and_splits_the_time():
    fake = FakeGateway([snap(0, 0), snap(4, 2), snap(4, 4)])
    slept = []
    res = run_profile(client(fake), models=["m"], duration_s=5, load=None, trace_models=[], out=None,
                      sleep=slept.append)
    assert slept == [5, 2.0]  # the window, then one wait for Ray's export
    (a,) = res.rows
    assert (a.requests, a.engine_requests) == (4, 4)
    ms = {p: round(a.phase_s(p) * 1000, 6) for p in a.PHASES}
    assert ms == {"gateway": 1.0, "queue": 10.0, "prefill": 20.0, "decode": 50.0, "relay": 19.0}
    assert res.report["anatomy"][0]["e2e_ms"] == 100.0 and "traces" not in res.report
    assert [c[1] for c in fake.calls] == ["/admin/profile/snapshot"] * 3


def test_trace_run_stops_and_downloads(tmp_path):
    fake = FakeGateway([snap(0, 0), snap(2, 2)])
    loads = []
    res = run_profile(client(fake), models=["m"], duration_s=3, load=LoadSpec(2, "sk"), trace_models=["m"],
                      out=tmp_path, sleep=lambda s: None,
                      load_runner=lambda url, models, load, d: loads.append((url, models, load.users, d))
                      or {"m": {"ok": 2, "failed": 0}})
    assert loads == [("http://gw", ["m"], 2, 3)]
    paths = [c[1] for c in fake.calls]
    assert paths[0] == "/admin/profile/start" and paths[-2:] == ["/admin/profile/stop",
                                                                 f"/admin/profile/files/{SESSION}/m/n1/t.gz"]
    stop_body = fake.calls[-2][2]
    assert stop_body["session"] == SESSION and stop_body["models"] == ["m"] and stop_body["window_s"] > 3
    assert (tmp_path / SESSION / "m" / "n1" / "t.gz").read_bytes() == b"abc"
    assert res.report["traces"]["files"] == [str(tmp_path / SESSION / "m" / "n1" / "t.gz")]
    assert res.report["load"] == {"m": {"ok": 2, "failed": 0}}


def test_profiler_is_stopped_when_the_window_fails(tmp_path):
    fake = FakeGateway([snap(0, 0)])

    def broken_load(*a):
        raise ProfileError("the built-in load on 'm' failed: HTTP 401")

    with pytest.raises(ProfileError, match="HTTP 401"):
        run_profile(client(fake), models=["m"], duration_s=3, load=LoadSpec(1, None), trace_models=["m"],
                    out=tmp_path, sleep=lambda s: None, load_runner=broken_load)
    assert [c[1] for c in fake.calls][-1] == "/admin/profile/stop"


def test_gateway_refusal_is_a_profile_error_with_its_message():
    fake = FakeGateway([snap(0, 0)], start_status=409)
    with pytest.raises(ProfileError, match=r"HTTP 409: No model has no engine.profiler_dir"):
        run_profile(client(fake), models=["m"], duration_s=1, load=None, trace_models=["m"], out=None,
                    sleep=lambda s: None)


def test_unreachable_gateway_is_one_line():
    c = ProfileClient("http://127.0.0.1:9", "adm", timeout_s=2)
    with pytest.raises(ProfileError, match="cannot reach the gateway at http://127.0.0.1:9"):
        c.snapshot()


# ---- the CLI's refusals (before any HTTP) --------------------------------------------------------------------
def fleet_file(tmp_path: Path, profiler_dir: str | None = None) -> Path:
    engine = {"profiler_dir": profiler_dir} if profiler_dir else {}
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump({"gateway": {"admin_key_env": "LMFLEET_T_ADMIN", "port": 9},
                                 "models": [{"name": "m", "source": "builtin:tiny-random", "engine": engine},
                                            {"name": "n", "source": "builtin:tiny-random"}]}))
    return p


@pytest.mark.parametrize("args, profiler_dir, env, fragment", [
    (["--trace"], None, {"LMFLEET_T_ADMIN": "adm"}, "No model has no engine.profiler_dir"),
    (["--trace", "--model", "n"], "/tmp/p", {"LMFLEET_T_ADMIN": "adm"}, "Model(s) 'n' have no engine.profiler_dir"),
    (["--model", "zz"], None, {"LMFLEET_T_ADMIN": "adm"}, "--model zz: not in the fleet file"),
    ([], None, {}, "needs the gateway's admin key: set $LMFLEET_T_ADMIN or $LMFLEET_ADMIN_KEY"),
], ids=["no-dir", "named-model-without-dir", "unknown-model", "no-admin-key"])
def test_cli_refuses_in_one_line(tmp_path, monkeypatch, args, profiler_dir, env, fragment):
    monkeypatch.delenv("LMFLEET_ADMIN_KEY", raising=False)
    r = CliRunner().invoke(app, ["profile", "-c", str(fleet_file(tmp_path, profiler_dir)), *args], env=env)
    assert r.exit_code == 2, r.output
    out = r.stderr if hasattr(r, "stderr") and r.stderr else r.output
    lines = out.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], out


def test_cli_unreachable_gateway_exits_1(tmp_path):
    r = CliRunner().invoke(app, ["profile", "-c", str(fleet_file(tmp_path)), "--duration", "1"],
                           env={"LMFLEET_T_ADMIN": "adm"})
    assert r.exit_code == 1 and "cannot reach the gateway at http://127.0.0.1:9" in r.output


# ---- the engine's settings ---------------------------------------------------------------------------------
def test_profiler_dir_becomes_vllm_profiler_config_per_model():
    fleet = parse_config({"models": [{"name": "Org/Tiny.v1", "source": "builtin:tiny-random",
                                      "engine": {"profiler_dir": "/var/prof/"}},
                                     {"name": "plain", "source": "builtin:tiny-random"}]})
    traced, plain = fleet.models
    assert profiler_trace_dir(traced) == "/var/prof/org-tiny-v1" and profiler_trace_dir(plain) is None
    kw = llm_config_kwargs(traced, "/weights")["engine_kwargs"]
    assert kw["profiler_config"] == {"profiler": "torch", "torch_profiler_dir": "/var/prof/org-tiny-v1",
                                     "torch_profiler_with_stack": False}
    assert "profiler_dir" not in kw
    assert "profiler_config" not in llm_config_kwargs(plain, "/weights")["engine_kwargs"]


def test_extra_args_profiler_config_wins():
    fleet = parse_config({"models": [{"name": "m", "source": "builtin:tiny-random",
                                      "engine": {"profiler_dir": "/p", "extra_args": {"profiler_config": {"x": 1}}}}]})
    assert llm_config_kwargs(fleet.models[0], "/w")["engine_kwargs"]["profiler_config"] == {"x": 1}


@pytest.mark.parametrize("value", ["relative/dir", "~/prof", "/"])
def test_profiler_dir_must_be_absolute_and_the_error_names_the_key(value):
    with pytest.raises(ConfigError) as e:
        parse_config({"models": [{"name": "m", "source": "builtin:tiny-random", "engine": {"profiler_dir": value}}]})
    assert "models[0].engine.profiler_dir" in str(e.value)
