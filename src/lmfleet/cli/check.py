"""Placeholder: `lmfleet check` is not implemented yet."""

import typer


def check() -> None:
    """Not implemented yet."""
    typer.echo("not implemented yet", err=True)
    raise typer.Exit(2)
