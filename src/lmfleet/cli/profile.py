"""``lmfleet profile``: where each model's request time goes (request anatomy), and engine traces (``--trace``).

Talks to a running fleet's gateway with the admin key; see docs/profile.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from lmfleet.cli.common import EXIT_USAGE, fail, load_or_exit
from lmfleet.config.models import FleetConfig
from lmfleet.engine.app import profiler_trace_dir
from lmfleet.profile.anatomy import render_table
from lmfleet.profile.client import LoadSpec, ProfileClient, ProfileError, run_profile
from lmfleet.profile.traces import not_configured_message

ADMIN_KEY_ENV = "LMFLEET_ADMIN_KEY"
"""Where the admin key is read from when the fleet file names no ``gateway.admin_key_env``."""

OPEN_HINT = ("open a .pt.trace.json.gz file at https://ui.perfetto.dev (or chrome://tracing), or the folder with "
             "TensorBoard's profiler plugin: pip install torch-tb-profiler; tensorboard --logdir {folder}")


def gateway_url(fleet: FleetConfig) -> str:
    host = fleet.gateway.host
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    return f"http://[{host}]:{fleet.gateway.port}" if ":" in host else f"http://{host}:{fleet.gateway.port}"


def admin_key(fleet: FleetConfig) -> str | None:
    env = fleet.gateway.admin_key_env
    return (os.environ.get(env) if env else None) or os.environ.get(ADMIN_KEY_ENV)


def client_key(fleet: FleetConfig) -> str | None:
    """A client key for the built-in load: the fleet's first configured key (None: the gateway is open)."""
    from lmfleet.gateway.build import load_api_keys  # imports the gateway (see lmfleet.cli)

    try:
        keys = load_api_keys(fleet.gateway, os.environ)
    except Exception:
        return None
    return sorted(keys)[0] if keys else None


def profile(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="The running fleet's file (gateway address, keys, models)."),
    url: Optional[str] = typer.Option(None, "--url", help="Gateway URL (default: from the fleet file)."),
    duration: float = typer.Option(20.0, "--duration", min=1.0, max=3600.0, help="Seconds of traffic to measure."),
    load: int = typer.Option(0, "--load", min=0, max=256, help="Built-in load: N concurrent streams per model for the window (0: watch live traffic)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, max=4096, help="Tokens per request of the built-in load."),
    models: Optional[list[str]] = typer.Option(None, "--model", "-m", help="Only these models (repeatable). Default: all."),
    trace: bool = typer.Option(False, "--trace", help="Also record vLLM torch profiler traces on every replica (needs engine.profiler_dir)."),
    out: Path = typer.Option(Path("lmfleet-profile"), "--out", "-o", help="Folder for the trace files (one subfolder per session)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LMFLEET_API_KEY", help="Client key for the built-in load (default: the fleet's first key)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Split each model's end-to-end request time into gateway, queue, prefill, decode and relay; with --trace,
    record engine traces on every replica and gather them from every node.

    Exit 1 when the gateway refuses or cannot be reached; 2 on bad options or a fleet file that does not load."""

    fleet = load_or_exit(config)
    names = [m.name for m in fleet.models]
    unknown = sorted(set(models or []) - set(names))
    if unknown:
        fail(f"--model {', '.join(unknown)}: not in the fleet file (models: {', '.join(names)})", EXIT_USAGE)
    selected = list(models) if models else names
    traced: list[str] = []
    if trace:
        by_name = {m.name: m for m in fleet.models}
        missing = [n for n in selected if profiler_trace_dir(by_name[n]) is None]
        if (models and missing) or len(missing) == len(selected):
            fail(not_configured_message(missing if models else []), EXIT_USAGE)
        traced = [n for n in selected if n not in missing]
    key = admin_key(fleet)
    if not key:
        where = f"${fleet.gateway.admin_key_env} or ${ADMIN_KEY_ENV}" if fleet.gateway.admin_key_env else f"${ADMIN_KEY_ENV}"
        fail(f"lmfleet profile needs the gateway's admin key: set {where}", EXIT_USAGE)
    say = (lambda s: typer.echo(f"lmfleet: {s}", err=True))
    spec = LoadSpec(load, api_key or client_key(fleet), max_tokens) if load else None
    client = ProfileClient(url or gateway_url(fleet), key)
    try:
        result = run_profile(client, models=selected, duration_s=duration, load=spec, trace_models=traced,
                             out=out, progress=say)
    except ProfileError as e:
        fail(str(e), 1)
    finally:
        client.close()
    if as_json:
        typer.echo(json.dumps(result.report, indent=2))
        return
    typer.echo(f"request anatomy over {result.report['window_s']:g} s (means per locally served request; gateway "
               f"figures from process {result.report['gateway_pid']}):")
    typer.echo(render_table(result.rows) if result.rows else "  no traffic seen")
    for a in result.rows:
        for note in a.notes:
            typer.echo(f"  {a.model}: {note}")
    if result.report.get("engine_error"):
        typer.echo(f"  engine figures unavailable: {result.report['engine_error']}")
    traces = result.report.get("traces")
    if traces:
        typer.echo(f"traces: {len(traces['files'])} file(s) in {traces['folder']}")
        for f in traces["files"]:
            typer.echo(f"  {f}")
        for s in [*traces["skipped"], *traces["errors"]]:
            typer.echo(f"  not collected: {s}")
        typer.echo("  " + OPEN_HINT.format(folder=traces["folder"]))
