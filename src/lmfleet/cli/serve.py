"""``lmfleet serve``: deploy the fleet on Ray Serve + vLLM and run the gateway in front."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lmfleet.cli.common import load_or_exit
from lmfleet.cli.terminal import open_terminal
from lmfleet.serve.timing import Phases


def serve(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Fleet file (default: the embedded default fleet)."),
    host: Optional[str] = typer.Option(None, help="Gateway listen address (default: gateway.host, 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="Gateway port (default: gateway.port, 8000)."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Ray cluster to join (else RAY_ADDRESS, then cluster.address, else a local head)."),
    deploy_timeout: float = typer.Option(900.0, help="Seconds to wait for every engine to come up."),
    gateway_workers: Optional[int] = typer.Option(
        None, "--gateway-workers", min=1, help="Gateway processes sharing the port (default: gateway.workers, 1)."),
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Also print the engines' and Ray's own log lines here (else: Ray's log folder)."),
) -> None:
    """Deploy every model of the fleet on Ray Serve (vLLM engines) and serve the OpenAI-compatible gateway."""
    from lmfleet.serve.runner import run_serve  # imports the gateway and Ray (see lmfleet.cli)

    phases = Phases()
    fleet = load_or_exit(config)
    term = open_terminal("serve", verbose=verbose)
    code = run_serve(fleet, host=host or fleet.gateway.host, port=port or fleet.gateway.port, address=address,
                     deploy_timeout_s=deploy_timeout, progress=term.say, workers=gateway_workers,
                     config_path=config, verbose=verbose, phases=phases)
    term.exit(code)
