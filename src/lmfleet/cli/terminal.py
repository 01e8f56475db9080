"""The terminal of a long-running command (``serve``, ``gateway``, ``cluster up``, ``bench``): lmfleet's own lines.

By default the user sees only lines that start with ``lmfleet:`` (progress, the ready line, the URL, warnings a
user can act on, errors). Everything else written by the process or by the libraries in it (Ray's and vLLM's
log lines, Ray's error messages pushed to the driver, Python tracebacks, extension modules' messages at exit)
goes to a log file whose path the command prints: file descriptors 1 and 2 are pointed at that file, and lmfleet's
lines are written to a duplicate of the original stdout. ``--verbose`` leaves the descriptors alone.

Only a real ``lmfleet`` process redirects and ends with :func:`os._exit` (see :func:`standalone`): commands run
in-process (tests through typer's ``CliRunner``) keep their streams and return normally.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, TextIO

__all__ = ["Terminal", "open_terminal", "standalone", "terminal_line"]

_STANDALONE = False


def standalone() -> None:
    """Called by ``lmfleet``'s entry point: this process belongs to the command, so it may redirect its
    descriptors and end with ``os._exit``."""
    global _STANDALONE
    _STANDALONE = True


def terminal_line(record: logging.LogRecord, log_path: Path | None = None) -> str:
    """One terminal line for a warning or error that lmfleet logged: its first line, no stack trace (the rest is
    in the log file at ``log_path``, which the line names when something was left out)."""
    lines = record.getMessage().strip().splitlines() or [""]
    level = "error" if record.levelno >= logging.ERROR else "warning"
    more = len(lines) > 1 or record.exc_info is not None
    return f"lmfleet: {level}: {lines[0]}" + (f" (details in {log_path})" if more and log_path else "")


class _TerminalHandler(logging.Handler):
    """lmfleet's own warnings and errors, one line each, on the terminal."""

    def __init__(self, term: "Terminal") -> None:
        super().__init__(logging.WARNING)
        self.term = term

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.term.say(terminal_line(record, self.term.log_path), log=False)  # the file handler logs the whole record
        except Exception:  # a closed terminal must not break the command
            self.handleError(record)


@dataclass
class Terminal:
    """Where a command's own lines go (``out``; errors: ``err``) and where everything else went (``log_path``;
    None: here)."""

    out: TextIO
    err: TextIO
    log_path: Path | None = None
    started: float = field(default_factory=time.monotonic)

    def say(self, line: str, *, log: bool = True) -> None:
        stream = self.err if line.startswith("lmfleet: error") else self.out  # errors on stderr, as every command
        stream.write(line + "\n")
        stream.flush()
        if log and self.log_path is not None:  # the log file tells the whole story, the user's lines included
            print(line, file=sys.stderr, flush=True)

    def exit(self, code: int) -> NoReturn:
        """End the command with ``code``. A real process ends without running extension modules' finalizers
        (Triton's nanobind prints "leaked …" lines at interpreter exit) once every stream is flushed; the command
        has already closed what it opened (engines, Ray, the gateway, the ledger)."""
        logging.shutdown()
        for s in (sys.stdout, sys.stderr, self.out, self.err):
            try:
                s.flush()
            except Exception:  # a closed stream has nothing left to flush
                pass
        if _STANDALONE:
            os._exit(code)
        import typer

        raise typer.Exit(code)


def log_file_path(command: str) -> Path:
    """``<lmfleet cache>/logs/<command>-<UTC time>-<pid>.log``."""
    from lmfleet.models.registry import cache_dir

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return cache_dir() / "logs" / f"{command.replace(' ', '-')}-{stamp}-{os.getpid()}.log"


def open_terminal(command: str, *, verbose: bool = False) -> Terminal:
    """Set up the command's terminal and logging. Quiet (the default, in a real process): descriptors 1 and 2
    go to a new log file, lmfleet's own lines and one-line warnings to the terminal (errors to its stderr)."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    if verbose or not _STANDALONE:
        logging.basicConfig(level=logging.INFO, format=fmt._fmt)
        for noisy in ("httpx", "ray", "filelock"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        return Terminal(out=sys.stdout, err=sys.stderr)
    path = log_file_path(command)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    term_fd, term_err_fd = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    term = Terminal(out=os.fdopen(term_fd, "w", buffering=1, encoding="utf-8", errors="replace"),
                    err=os.fdopen(term_err_fd, "w", buffering=1, encoding="utf-8", errors="replace"), log_path=path)
    file_handler = logging.StreamHandler(sys.stderr)
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("lmfleet").addHandler(_TerminalHandler(term))
    def excepthook(kind, value, tb):  # a bug: the trace in the file, one line and where to look here
        sys.__excepthook__(kind, value, tb)
        first = str(value).strip().splitlines()[0] if str(value).strip() else ""
        term.say(f"lmfleet: error: unexpected {kind.__name__}: {first} (traceback in {path})", log=False)

    sys.excepthook = excepthook
    term.say(f"lmfleet: this command's log: {path} (--verbose prints it here)")
    return term
