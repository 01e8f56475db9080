"""Loading a model's tokenizer: one place for the transformers call, its options and its error."""

from __future__ import annotations

from typing import Any

from lmfleet.errors import LmfleetError

__all__ = ["TokenizerLoadError", "load_tokenizer"]


class TokenizerLoadError(LmfleetError, RuntimeError):
    """The tokenizer at a location could not be loaded; the message names the location and the cause."""


def load_tokenizer(location: str, *, trust_remote_code: bool = False, local_files_only: bool = True) -> Any:
    """``AutoTokenizer.from_pretrained(location)``: a folder, or a hub id when ``local_files_only`` is False.

    ``trust_remote_code``: run tokenizer code shipped with the checkpoint (``engine.trust_remote_code``).
    ``local_files_only``: never reach the hub (the default: clusters are often air-gapped).
    Raises :class:`TokenizerLoadError` whatever transformers raised underneath (kept as ``__cause__``).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(location, local_files_only=local_files_only,
                                             trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ImportError, JSON errors... one error for callers
        first = str(e).splitlines()[0][:200] if str(e) else ""
        where = "offline" if local_files_only else "(hub allowed)"
        raise TokenizerLoadError(f"cannot load a tokenizer from {location} {where}: {type(e).__name__}: {first}") from e
