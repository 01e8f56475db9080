"""The ``lmfleet`` command line. Each command group lives in its own module under ``lmfleet.cli``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from lmfleet.config import ConfigError, default_config_text, load_config
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

EXIT_CONFIG = 2


def fail(message: str, code: int = EXIT_CONFIG) -> "typer.Exit":
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load_or_exit(path: Optional[Path]) -> FleetConfig:
    """Load a fleet file for a command; a bad file exits with code 2 and the full message."""
    try:
        return load_config(path)
    except ConfigError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_CONFIG) from None


ConfigOpt = typer.Option(None, "--config", "-c", help="Fleet file (default: the embedded default fleet).")


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


def _register() -> None:
    from lmfleet.cli import bench, check, cluster, serve, usage

    app.command("serve")(serve.serve)
    app.command("check")(check.check)
    app.command("usage")(usage.usage)
    app.add_typer(cluster.app, name="cluster")
    app.add_typer(bench.app, name="bench")


_register()


def main() -> None:
    app(prog_name="lmfleet")


if __name__ == "__main__":
    sys.exit(main())
