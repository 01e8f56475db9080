import typer


def serve() -> None:
    """Not implemented yet."""
    raise typer.Exit(2)
