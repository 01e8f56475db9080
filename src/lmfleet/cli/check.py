"""`lmfleet check`: find the failures of a fleet before deploying it (GPU fit, memory, parallelism, timeouts, tokenizer, links)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from lmfleet.check.hardware import gpu_model
from lmfleet.check.report import render_table, to_json
from lmfleet.check.result import exit_code
from lmfleet.check.runner import CheckOptions, run_checks
from lmfleet.check.timeouts import LoadAssumptions
from lmfleet.cli.common import EXIT_USAGE, data_stdout, fail, load_or_exit


def check(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Fleet file (default: the embedded default fleet)."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray address to join (else RAY_ADDRESS, then "
                                                                   "cluster.address, else a throwaway local Ray)."),
    offline: bool = typer.Option(False, "--offline", help="Config-only: no Ray; config, model files, planner, tokenizer."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    warn_ok: bool = typer.Option(False, "--warn-ok", help="Exit 0 when there are warnings but no failures."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU to plan for when none is measured: h200, h100, a100-80, "
                                                          "a100-40, l40s, l4, a10g, rtx4090, or a size like 80GiB."),
    tpot_ms: Optional[float] = typer.Option(None, "--tpot-ms", min=0.1, help="Measured time per output token (ms) "
                                                                             "instead of the estimate."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Longest generation clients ask for "
                                                                               "(default: max_model_len)."),
    avg_tokens: int = typer.Option(512, "--avg-tokens", min=1, help="Typical generation length, for queue waits."),
    burst: Optional[int] = typer.Option(None, "--burst", min=1, help="Concurrent requests at peak "
                                                                     "(default: twice what min_replicas admit)."),
    busy_fraction: float = typer.Option(0.05, "--busy-fraction", min=0.0, max=1.0,
                                        help="A GPU with more of its memory in use than this is not free."),
) -> None:
    """Check a fleet before deploying it; exit 0 all passed, 1 warnings only (0 with --warn-ok), 2 failures."""
    cfg = load_or_exit(config)
    try:
        gpu_spec = gpu_model(gpu) if gpu else None
    except ValueError as e:
        fail(f"--gpu: {e}", EXIT_USAGE)
    opts = CheckOptions(offline=offline, address=address, gpu=gpu_spec, busy_fraction=busy_fraction,
                        load=LoadAssumptions(tpot_ms=tpot_ms, max_tokens=max_tokens, avg_tokens=avg_tokens, burst=burst))
    err = Console(stderr=True)
    progress = (lambda msg: None) if as_json else (lambda msg: err.print(f"[dim]lmfleet check: {msg}[/]"))
    with data_stdout() as stdout:
        try:
            results, extra = run_checks(cfg, opts, progress)
        except Exception as e:  # noqa: BLE001 - e.g. Ray unreachable: say so and exit 2, no traceback
            fail(f"lmfleet check could not run: {type(e).__name__}: {e}", EXIT_USAGE)
        code = exit_code(results, warn_ok=warn_ok)
        if as_json:
            stdout.write(to_json(results, exit_code=code, extra=extra) + "\n")
            stdout.flush()
    if not as_json:
        out = Console()
        render_table(results, out if out.is_terminal else Console(width=160),  # pipes/CI: wide enough to read
                     title=f"lmfleet check {config or '(embedded default fleet)'}")
    raise typer.Exit(code)
