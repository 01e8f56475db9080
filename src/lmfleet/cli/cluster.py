"""Placeholder: `lmfleet cluster` is not implemented yet."""

import typer

app = typer.Typer(help="Not implemented yet.", no_args_is_help=True)


@app.command("todo")
def todo() -> None:
    """Not implemented yet."""
    raise typer.Exit(2)
