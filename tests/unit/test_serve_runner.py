"""lmfleet serve turns Ray Serve's refusals into one clear error line (exit 1), not a traceback."""

from __future__ import annotations

import pytest


def test_serve_refusal_becomes_a_deploy_error(monkeypatch):
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from lmfleet.serve.runner import DeployError, deploy

    def refuse(*a, **kw):
        raise RayServeException("`ingress_request_router` requires HAProxy.")

    monkeypatch.setattr(serve, "run_many", refuse)
    with pytest.raises(DeployError, match="refused the deployment.*requires HAProxy"):
        deploy([])


@pytest.mark.parametrize("verbose", [False, True])
def test_engine_and_ray_logs_reach_the_terminal_only_when_verbose(monkeypatch, verbose):
    """lmfleet serve keeps Ray's and the engines' log lines in Ray's log folder unless --verbose."""
    import logging

    from lmfleet.config import parse_config
    from lmfleet.serve import runner
    from lmfleet.serve.runner import connect_ray

    seen = {}

    def fake_connect(address, *, local=None, env_vars=None, logging_level=logging.WARNING, **init_kwargs):
        seen.update(init_kwargs, logging_level=logging_level)
        return True

    monkeypatch.setattr(runner, "connect", fake_connect)
    fleet = parse_config({"models": [{"name": "m", "source": "builtin:tiny-random"}]})
    assert connect_ray(fleet, "10.0.0.1:6379", verbose=verbose) is True
    assert seen["log_to_driver"] is verbose
    assert seen["logging_level"] == (logging.INFO if verbose else logging.WARNING)


@pytest.mark.parametrize("address", ["10.0.0.1:6379", None])
@pytest.mark.parametrize("operator", [None, "5000"])
def test_the_engines_export_their_metrics_every_second_unless_the_operator_says(monkeypatch, address, operator):
    """Ray's default metrics report (10 s) would leave the engine queue counts seconds old: lmfleet serve sets 1 s
    for the job's actors (runtime_env) on a joined cluster and a local head; the operator's value wins."""
    from lmfleet.config import parse_config
    from lmfleet.serve import runner

    seen = {}

    def fake_connect(address, *, local=None, env_vars=None, **kwargs):
        seen["env"], seen["head"] = dict(env_vars), dict(local.env) if local is not None else {}
        return local is not None

    monkeypatch.setattr(runner, "connect", fake_connect)
    if operator is None:
        monkeypatch.delenv("RAY_metrics_report_interval_ms", raising=False)
    else:
        monkeypatch.setenv("RAY_metrics_report_interval_ms", operator)
    runner.connect_ray(parse_config({"models": [{"name": "m", "source": "builtin:tiny-random"}]}), address)
    assert seen["env"]["RAY_metrics_report_interval_ms"] == (operator or "1000")
    assert "RAY_metrics_report_interval_ms" not in seen["head"]  # the metrics agent keeps its hold on late gauges


def test_serve_has_a_verbose_switch():
    from typer.testing import CliRunner

    from lmfleet.cli.main import app

    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    assert "--verbose" in out


def test_a_redeploy_keeps_the_list_of_apps_to_tear_down_current(monkeypatch):
    """What lmfleet serve deletes at shutdown on a joined cluster follows the models apply deployed."""
    from types import SimpleNamespace as NS

    from lmfleet.serve import runner

    sent = []
    monkeypatch.setattr(runner, "deploy", sent.append)
    apps = [NS(name="a", v=1), NS(name="b", v=1)]
    runner.deploy_into(apps, [NS(name="b", v=2), NS(name="c", v=1)])
    assert [(a.name, a.v) for a in apps] == [("a", 1), ("b", 2), ("c", 1)]
    assert [[a.name for a in more] for more in sent] == [["b", "c"]]
