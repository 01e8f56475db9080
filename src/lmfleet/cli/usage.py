"""Placeholder: `lmfleet usage` is not implemented yet."""

import typer


def usage() -> None:
    """Not implemented yet."""
    typer.echo("not implemented yet", err=True)
    raise typer.Exit(2)
