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
