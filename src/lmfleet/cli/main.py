"""The ``lmfleet`` command line. Each command group lives in its own module under ``lmfleet.cli``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from lmfleet.cli import bench, check, cluster, gateway, profile, serve, usage
from lmfleet.cli.common import load_or_exit
from lmfleet.config import default_config_text
from lmfleet.config.models import FleetConfig

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
config_app = typer.Typer(help="Inspect and validate fleet files.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("validate")
def config_validate(path: Path = typer.Argument(..., help="Fleet file to check.")) -> None:
    """Check a fleet file; exit 2 with every problem (file, line, key path, expectation) if it is bad."""
    cfg = load_or_exit(path)
    typer.echo(f"{path}: ok ({len(cfg.models)} model(s): {', '.join(m.name for m in cfg.models)}; "
               f"{len(cfg.providers)} provider(s))")


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of fleet files."""
    typer.echo(json.dumps(FleetConfig.model_json_schema(), indent=2))


@config_app.command("default")
def config_default() -> None:
    """Print the embedded default fleet file."""
    typer.echo(default_config_text(), nl=False)


app.command("serve")(serve.serve)
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
