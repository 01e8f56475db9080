"""``lmfleet config``: check a fleet file, show it as lmfleet reads it (secrets masked), print its schema or the
embedded default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml

from lmfleet.cli.common import load_or_exit
from lmfleet.config import default_config_text
from lmfleet.config.models import FleetConfig
from lmfleet.config.redact import redact

app = typer.Typer(help="Inspect and validate fleet files.", no_args_is_help=True)


@app.command("validate")
def validate(path: Path = typer.Argument(..., help="Fleet file to check.")) -> None:
    """Check a fleet file; exit 2 with every problem (file, line, key path, expectation) if it is bad."""
    cfg = load_or_exit(path)
    typer.echo(f"{path}: ok ({len(cfg.models)} model(s): {', '.join(m.name for m in cfg.models)}; "
               f"{len(cfg.providers)} provider(s))")


@app.command("show")
def show(
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          help="Fleet file (default: the embedded default fleet)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of YAML."),
) -> None:
    """Print the fleet as lmfleet reads it, every default filled in; passwords, keys and tokens show as ***."""
    data = redact(load_or_exit(config).model_dump(mode="json"))
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)


@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of fleet files."""
    typer.echo(json.dumps(FleetConfig.model_json_schema(), indent=2))


@app.command("default")
def default() -> None:
    """Print the embedded default fleet file."""
    typer.echo(default_config_text(), nl=False)
