"""What every ``lmfleet`` command shares: loading the fleet file and failing with one kind of message.

Errors print ``lmfleet: error: MESSAGE`` on stderr and exit with the command's code (2: bad input or a
fleet file that does not load, unless a command documents another code).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn, Optional, TextIO

import typer

from lmfleet.config import ConfigError, load_config
from lmfleet.config.models import FleetConfig

__all__ = ["EXIT_USAGE", "data_stdout", "fail", "load_or_exit"]

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``lmfleet: error: MESSAGE`` on stderr and end the command with exit ``code``."""
    typer.echo(f"lmfleet: error: {message}", err=True)
    raise typer.Exit(code)


def load_or_exit(path: Optional[Path]) -> FleetConfig:
    """Load a fleet file for a command (None: the embedded default); a bad file exits 2 with every problem."""
    try:
        return load_config(path)
    except ConfigError as e:
        fail(str(e), EXIT_USAGE)


@contextlib.contextmanager
def data_stdout() -> Iterator[TextIO]:
    """Yield the real stdout for a ``--json`` document; anything else printed meanwhile goes to stderr.

    A Ray driver prints cluster events (``(raylet) The node ... has been marked dead``) on ``sys.stdout`` from a
    background thread; inside this block they land on stderr, so the JSON on stdout stays parseable. The block
    ends by disconnecting the driver (when one is connected), whose thread would otherwise print an event that
    arrives later, at exit, after the document.
    """
    real = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield real
        finally:
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                ray.shutdown()
