"""`lmfleet cluster`: bring a Ray cluster up or down, join a worker by hand, show the fleet's state."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
import yaml

from lmfleet.cli.common import EXIT_USAGE, data_stdout, fail, load_or_exit
from lmfleet.cluster.join import (
    JoinError,
    JoinSpec,
    auth_env,
    normalize_head_address,
    parse_labels,
    present_ray_token,
    ray_start_argv,
)
from lmfleet.cluster.launcher import LauncherError, launcher_config, launcher_warnings, manual_commands
from lmfleet.cluster.placement import nodes_from_cluster, plan_placement
from lmfleet.cluster.connect import NoRayHead
from lmfleet.cluster.probe import collect_status
from lmfleet.cluster.status import render_status
from lmfleet.config.models import FleetConfig
from lmfleet.config.redact import redact_text

app = typer.Typer(help="Start, join and inspect the Ray cluster the fleet runs on.", no_args_is_help=True)

ConfigOpt = typer.Option(None, "--config", "-c", help="Fleet file (its `cluster:` section).")


def _ray_bin() -> str:
    """The `ray` script of this Python environment (the venv's, not whatever is first on PATH)."""
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


def _launcher_file(cfg: FleetConfig) -> tuple[Path, str]:
    try:
        text = yaml.safe_dump(launcher_config(cfg.cluster), sort_keys=False)
    except LauncherError as e:
        fail(str(e), EXIT_USAGE)
    path = Path(cfg.cluster.launcher_path or f".lmfleet/{cfg.cluster.name}.ray-cluster.yaml").expanduser()
    return path, "# Ray cluster launcher file written by `lmfleet cluster up`; regenerated on every run.\n" + text


def _ensure_token(path_text: str) -> Path:
    """The local token file `ray up` copies to every node; created (0600) if missing, never printed."""
    path = Path(path_text).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        typer.echo(f"lmfleet: created a new Ray auth token in {path} (mode 0600)", err=True)
    elif path.stat().st_mode & 0o077:
        typer.echo(f"lmfleet: warning: the Ray auth token {path} is readable by others (mode "
                   f"{path.stat().st_mode & 0o777:04o}); anyone who reads it can join or drive the cluster. "
                   f"Run: chmod 600 {shlex.quote(str(path))}", err=True)
    return path


def _show_plan(cfg: FleetConfig) -> None:
    nodes = nodes_from_cluster(cfg.cluster)
    if not nodes or not any(n.gpus for n in nodes):
        return
    plan = plan_placement(cfg.models, nodes, gpu=True)
    typer.echo("# Placement plan (from the fleet file's GPU counts):")
    typer.echo("\n".join(f"#   {line}" for line in plan.explain().splitlines()))


@app.command("up")
def up(
    config: Optional[Path] = ConfigOpt,
    print_only: bool = typer.Option(False, "--print", help="Show the launcher file and the manual commands; run nothing."),
    yes: bool = typer.Option(True, "--yes/--confirm", help="Pass -y to `ray up` (no interactive prompt)."),
) -> None:
    """Write Ray's cluster launcher file from `cluster:` and start the cluster with `ray up`."""
    cfg = load_or_exit(config)
    path, text = _launcher_file(cfg)
    for w in launcher_warnings(cfg.cluster):
        typer.echo(f"lmfleet: warning: {w}", err=True)
    if print_only:  # a terminal, a CI log: secrets in setup_commands show masked (the written file keeps them)
        typer.echo(redact_text(f"# {path}\n{text}"))
        typer.echo("# Or by hand, without ray up:")
        typer.echo(redact_text("\n".join(manual_commands(cfg.cluster))))
        _show_plan(cfg)
        return
    _ensure_token(cfg.cluster.auth_token_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    typer.echo(f"lmfleet: wrote {path}")
    argv = [_ray_bin(), "up", str(path), *(["-y"] if yes else [])]
    typer.echo("lmfleet: running: " + shlex.join(argv))
    raise typer.Exit(subprocess.call(argv))


@app.command("down")
def down(
    config: Optional[Path] = ConfigOpt,
    print_only: bool = typer.Option(False, "--print", help="Show the command; run nothing."),
) -> None:
    """Stop the cluster that `cluster up` started (`ray down` on the same launcher file)."""
    cfg = load_or_exit(config)
    path, text = _launcher_file(cfg)
    argv = [_ray_bin(), "down", str(path), "-y"]
    if print_only:
        typer.echo(shlex.join(argv))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    raise typer.Exit(subprocess.call(argv))


@app.command("join")
def join(
    head_address: str = typer.Argument(..., help="The head's HOST or HOST:PORT (its GCS port, 6379 by default)."),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus", min=0, help="Logical CPUs to offer (default: Ray's count)."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=0, help="GPUs to offer (default: Ray's count)."),
    label: list[str] = typer.Option([], "--label", help="Node label KEY=VALUE (repeatable)."),
    node_ip_address: Optional[str] = typer.Option(None, "--node-ip-address", help="This node's address as the head sees it."),
    temp_dir: Optional[str] = typer.Option(None, "--temp-dir", help="Ray's temp/log folder for this node."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="File holding the head's Ray auth token (else RAY_AUTH_TOKEN[_PATH], ~/.ray/auth_token)."
    ),
    no_auth: bool = typer.Option(False, "--no-auth", help="The head runs without token auth (RAY_AUTH_MODE=disabled)."),
    block: bool = typer.Option(False, "--block", help="Stay in the foreground until the node stops."),
    print_only: bool = typer.Option(False, "--print", help="Show the command (without the token); run nothing."),
) -> None:
    """Join this machine to a running cluster as a worker (for nodes started by hand, e.g. rented VPS)."""
    try:
        spec = JoinSpec(
            head_address=normalize_head_address(head_address),
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            labels=parse_labels(label),
            node_ip_address=node_ip_address,
            temp_dir=temp_dir,
            block=block,
        )
        env_add = auth_env(os.environ, str(token_file) if token_file else None, auth=not no_auth)
    except JoinError as e:
        fail(str(e), EXIT_USAGE)
    argv = ray_start_argv(spec, _ray_bin())
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env_add.items()) + " " + shlex.join(argv)
    if print_only:
        typer.echo(shown)
        return
    typer.echo(f"joining {spec.head_address}: {shown}", err=True)
    raise typer.Exit(subprocess.call(argv, env={**os.environ, **env_add}))


@app.command("status")
def status(
    config: Optional[Path] = ConfigOpt,
    address: Optional[str] = typer.Option(None, "--address", help="Ray address (else RAY_ADDRESS, then cluster.address, else the cluster on this machine)."),
    gateway: Optional[str] = typer.Option(
        None, "--gateway", help="Gateway base URL for per-model load (default: the fleet file's gateway)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Nodes (alive/dead, CPUs, GPUs and free memory, labels), replicas and where they run, per-model load."""
    cfg = load_or_exit(config) if config else None
    present_ray_token()  # a head started by `lmfleet serve` (ray.init) requires the token too
    gateway_url = gateway
    admin_key = None
    if cfg is not None:
        gw = cfg.gateway
        gateway_url = gateway_url or f"http://{'127.0.0.1' if gw.host in ('0.0.0.0', '::') else gw.host}:{gw.port}"
        admin_key = os.environ.get(gw.admin_key_env) if gw.admin_key_env else None
    with data_stdout() as stdout:
        try:
            st = collect_status(address, gateway_url, admin_key, fleet=cfg)
        except NoRayHead as e:  # names the address already
            fail(str(e), 1)
        except ConnectionError as e:
            fail(f"cannot reach the Ray cluster at {address or 'RAY_ADDRESS / cluster.address / auto'}: {e}", 1)
        rows = _gateways()
        version = _fleet_version()
        if as_json:
            out = st.to_dict()
            if rows is not None:
                out["gateways"] = [{**asdict(r), "workers": r.workers} for r in rows]
            out["fleet_version"] = version
            typer.echo(json.dumps(out, indent=2), file=stdout)
        else:
            typer.echo(render_status(st), nl=False, file=stdout)
            if rows is not None:
                typer.echo(render_gateways(rows), nl=False, file=stdout)
            typer.echo(f"\nRunning fleet: {f'version {version}' if version is not None else 'none stored'} "
                       "(lmfleet apply)", file=stdout)
        stdout.flush()
    raise typer.Exit(0 if st.state == "healthy" else 3)


def _fleet_version() -> int | None:
    """The running fleet's version stored in the cluster (lmfleet.cluster.fleet_store); None: none, or unreadable."""
    from lmfleet.cluster.fleet_store import FleetStore, RayKV

    try:
        return FleetStore(RayKV()).current_version()
    except Exception as e:  # the rest of the status is still worth printing
        typer.echo(f"lmfleet: warning: cannot read the running fleet's version: {e}", err=True)
        return None


def _gateways() -> list | None:
    """Every gateway of the cluster's fleets, from their registry (lmfleet.gateway.routing.peers); None if unknown."""
    from lmfleet.gateway.routing.peers import gateway_rows, list_gateways  # imports Ray (see lmfleet.cli)

    try:
        answer = list_gateways()
    except Exception as e:  # the status of nodes and replicas is still worth printing
        typer.echo(f"lmfleet: warning: cannot read the gateway registry: {e}", err=True)
        return None
    return gateway_rows(answer) if answer is not None else []


def render_gateways(rows: list) -> str:
    """The gateways section of `lmfleet cluster status`."""
    if not rows:
        return "\nGateways: none registered\n"
    lines = ["", "Gateways:", f"  {'address':<24} {'role':<8} {'processes':<9} {'in-flight':>9}  {'last seen':<10} pids"]
    for r in rows:
        seen = f"{r.last_seen_s:.0f} s ago" + ("" if r.fresh else " (gone?)")
        lines.append(f"  {r.address:<24} {r.role:<8} {r.workers:<9} {r.in_flight:>9}  {seen:<10} "
                     f"{','.join(map(str, r.pids))}")
    return "\n".join(lines) + "\n"
