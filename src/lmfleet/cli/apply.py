"""``lmfleet apply``: compare a fleet file with the fleet running in the cluster, show what changes where and what
each change costs (:mod:`lmfleet.config.diff`), and store it as the cluster's next fleet version.

Gateway settings are taken by every gateway process; a model's Serve and engine keys are redeployed by the
``lmfleet serve`` process (:mod:`lmfleet.serve.rollout`). Exit codes: 0 done (or ``--dry-run``, or nothing to
change); 1 the cluster or its stored fleet cannot be reached, or the file holds changes this version of lmfleet
cannot apply to a running fleet (nothing is changed); 2 the file does not load (the loader's message, as
``config validate`` prints it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from lmfleet.cli.common import fail, load_or_exit
from lmfleet.cluster.fleet_store import FleetStore, VersionConflict
from lmfleet.config.diff import Change, applies_live, diff_fleets
from lmfleet.config.models import FleetConfig
from lmfleet.serve.rollout import describe, rollout_plan

EXIT_REFUSED = 1


def refused(changes: list[Change], running: FleetConfig) -> list[Change]:
    """The changes ``apply`` will not carry out on the running fleet (any of them: nothing is applied)."""
    return [c for c in changes if not applies_live(c, running)]


def _cell(value: object, item: bool) -> str:
    """``item``: the change adds or removes a whole list item (None: it is absent on that side)."""
    text = ("-" if item else "null") if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def changes_table(changes: list[Change], title: str, blocked: list[Change]) -> Table:
    """One row per change: key, where, cost, old and new value (secrets already masked by the diff)."""
    table = Table(title=Text(title), title_justify="left")
    for column in ("key", "where", "cost", "running", "new"):
        table.add_column(column, overflow="fold")
    for c in changes:
        style = "red" if c.cost == "restart needed" else "yellow" if c in blocked else None
        item = c.schema_path.endswith("[]")
        # Text, not markup: "models[m]" would be read as a style tag
        cells = (c.path, c.where, c.cost, _cell(c.old, item), _cell(c.new, item))
        table.add_row(*(Text(cell) for cell in cells), style=style)
    return table


def open_store(address: str | None, fleet: FleetConfig) -> FleetStore:
    """The running fleet's store in the cluster at ``address`` (--address, RAY_ADDRESS, cluster.address, else the
    cluster on this machine); the boundary the CLI tests replace."""
    from lmfleet.cluster.connect import NoRayHead, check_reachable, resolve_ray_address
    from lmfleet.cluster.fleet_store import CURRENT_KEY, RayKV
    from lmfleet.cluster.join import present_ray_token
    from lmfleet.ray_private import gcs_client

    present_ray_token()
    addr = resolve_ray_address(address, fleet)
    where = addr or "RAY_ADDRESS / cluster.address / auto"
    try:
        if addr:
            check_reachable(addr)  # in seconds; Ray's client gives up on a dead address after about 40 s
        kv = RayKV(gcs_client(addr))
        kv.get(CURRENT_KEY)  # reached, and the token (if the cluster wants one) accepted
    except NoRayHead as e:  # names the address already
        fail(str(e), EXIT_REFUSED)
    except Exception as e:  # Ray's client raises its own RPC errors as well as ConnectionError
        fail(f"cannot reach the Ray cluster at {where}: {e}", EXIT_REFUSED)
    return FleetStore(kv)


def apply(
    config: Path = typer.Option(..., "--config", "-c", help="The new fleet file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would change, change nothing, exit 0."),
    address: Optional[str] = typer.Option(
        None, "--address", help="Ray cluster of the running fleet (else RAY_ADDRESS, then cluster.address, else the "
        "cluster on this machine)."),
) -> None:
    """Show what a fleet file changes in the running fleet (where, and at what cost) and apply it."""
    new = load_or_exit(config)
    store = open_store(address, new)
    running = store.read()
    if running is None:
        fail("the cluster holds no running fleet: `lmfleet serve` stores the fleet it runs once its models are "
             "deployed (a version of lmfleet with `apply`); is the fleet started, on this cluster?", EXIT_REFUSED)
    changes = diff_fleets(running.fleet, new)
    console = Console(width=160, soft_wrap=False)
    if not changes:
        typer.echo(f"{config}: no change from the running fleet (version {running.version})")
        raise typer.Exit(0)
    blocked = refused(changes, running.fleet)
    console.print(changes_table(changes, f"{config} against the running fleet (version {running.version}, "
                                         f"{running.source})", blocked))
    plan = rollout_plan(changes)
    if dry_run:
        note = f"; {len(blocked)} cannot be applied live" if blocked else ""
        serve = f"; Serve would deploy: {describe(plan)}" if plan and not blocked else ""
        typer.echo(f"dry run: {len(changes)} change(s){note}{serve}; nothing changed")
        raise typer.Exit(0)
    if blocked:
        keys = ", ".join(f"{c.path} ({c.cost})" for c in blocked)
        fail(f"not applied, nothing changed: {keys} cannot be applied to a running fleet by this version of "
             "lmfleet; apply the other changes alone, or restart `lmfleet serve` with the new file", EXIT_REFUSED)
    try:
        stored = store.write(new, source=f"apply {config}", expected=running.version)
    except VersionConflict as e:
        fail(str(e), EXIT_REFUSED)
    typer.echo(f"applied: the running fleet is now version {stored.version} ({len(changes)} change(s)); every "
               "gateway process takes it within 2 s (/admin/state: fleet_version)")
    if plan:
        typer.echo(f"Serve: the `lmfleet serve` process deploys within 2 s: {describe(plan)}. In place keeps the "
                   "replicas; replica replacement replaces them one at a time while the gateways count only the "
                   "running ones (/admin/state: running_replicas); a new model is served once its engines run; a "
                   "removed model's application is deleted once its requests in flight end")
