from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

DONE_MARK = ".lmfleet-complete"
UNVERSIONED = "ok"


def is_complete(dest: Path, version: str = UNVERSIONED) -> bool:
    """``dest`` was built completely, by a builder of ``version`` (an older build counts as missing)."""
    mark = dest / DONE_MARK
    return mark.exists() and mark.read_text().strip() == version


@contextlib.contextmanager
def building(dest: Path, version: str = UNVERSIONED) -> Iterator[Path | None]:
    """Build into a temp folder next to ``dest`` and rename it into place when the block succeeds.

    Yields None when another process finished ``dest`` while we waited for the lock.
    A failed or interrupted build leaves nothing behind; a build of another ``version`` is replaced.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(dest, version):
            yield None
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            yield tmp
            (tmp / DONE_MARK).write_text(f"{version}\n")
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
