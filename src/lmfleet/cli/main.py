"""The ``lmfleet`` command line. Each command group lives in its own module under ``lmfleet.cli``."""

from __future__ import annotations

import os
import sys

import typer

from lmfleet.cli import apply, bench, check, cluster, config, gateway, profile, serve, usage

# lmfleet runs on air-gapped clusters: no telemetry unless the operator turns it on
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

app = typer.Typer(
    name="lmfleet",
    help="Run open LLMs on Ray + vLLM behind one OpenAI-compatible gateway with queue-aware overflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(config.app, name="config")
app.command("serve")(serve.serve)
app.command("apply")(apply.apply)
app.command("gateway")(gateway.gateway)
app.command("check")(check.check)
app.command("usage")(usage.usage)
app.add_typer(cluster.app, name="cluster")
app.add_typer(bench.app, name="bench")
app.command("profile")(profile.profile)


def main() -> None:
    from lmfleet.cli.terminal import standalone

    standalone()
    app(prog_name="lmfleet")


if __name__ == "__main__":
    sys.exit(main())
