"""Find a model's ``config.json`` without the network: local folder, builtin model, HF cache, or a shipped copy.

Big hub models (DeepSeek-V3, Llama-3-70B, Qwen2.5-32B...) cannot be downloaded by ``lmfleet check``;
their architecture fields ship with lmfleet under ``known_models/`` (one JSON per model, with its source).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from lmfleet.config.models import ModelConfig
from lmfleet.models import resolve_source


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's files were found. ``folder`` is None when only a config is known (shipped copy)."""

    config: dict[str, Any] | None
    folder: Path | None
    origin: str  # "local folder /x", "builtin:smollm2 -> /cache/..", "HF cache", "lmfleet's copy of ...", or why not found
    generation_config: dict[str, Any] | None = None


@lru_cache(maxsize=1)
def known_models() -> dict[str, dict[str, Any]]:
    """Shipped configs by lower-cased hub id (aliases included)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in resources.files("lmfleet.check").joinpath("known_models").iterdir():
        if not entry.name.endswith(".json"):
            continue
        cfg = json.loads(entry.read_text())
        for hub_id in [cfg["_hub_id"], *cfg.get("_aliases", [])]:
            out[hub_id.lower()] = cfg
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _from_folder(folder: Path, origin: str) -> ModelFiles:
    cfg = _read_json(folder / "config.json")
    if cfg is None:
        return ModelFiles(None, folder, f"{origin}: no readable config.json in {folder}")
    return ModelFiles(cfg, folder, origin, _read_json(folder / "generation_config.json"))


def _hf_cache_folder(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    hit = try_to_load_from_cache(repo_id, "config.json")
    return Path(hit).parent if isinstance(hit, str) else None


def find_model_files(source: str, *, build_builtin: bool = True) -> ModelFiles:
    """Locate ``source`` (as written in a fleet file) offline."""
    if source.startswith("builtin:"):
        if not build_builtin:
            return ModelFiles(None, None, f"{source} not built (run `lmfleet serve` once)")
        folder = Path(resolve_source(source, progress=lambda _m: None))
        return _from_folder(folder, f"{source} -> {folder}")
    p = Path(source).expanduser()
    if p.is_dir():
        return _from_folder(p, f"local folder {p}")
    if p.is_absolute() or source.startswith("."):
        return ModelFiles(None, None, f"folder {p} does not exist")
    cached = _hf_cache_folder(source)
    if cached is not None:
        return _from_folder(cached, f"Hugging Face cache {cached}")
    shipped = known_models().get(source.lower())
    if shipped is not None:
        return ModelFiles(shipped, None, f"lmfleet's copy of {shipped['_hub_id']}'s config.json ({shipped['_source']})")
    return ModelFiles(None, None, f"{source!r} is not a local folder, not in the Hugging Face cache, and not one of "
                                  f"lmfleet's known models")


def model_files(m: ModelConfig) -> ModelFiles:
    return find_model_files(m.source)


def tokenizer_location(m: ModelConfig, files: ModelFiles) -> str | None:
    """What to load the tokenizer from: the ``tokenizer:`` key, else the model's folder (None: nothing local)."""
    if m.tokenizer:
        if m.tokenizer.startswith("builtin:"):
            return find_model_files(m.tokenizer).folder and str(find_model_files(m.tokenizer).folder)
        p = Path(m.tokenizer).expanduser()
        if p.is_dir():
            return str(p)
        cached = _hf_cache_folder(m.tokenizer)
        return str(cached) if cached else m.tokenizer
    return str(files.folder) if files.folder else None
