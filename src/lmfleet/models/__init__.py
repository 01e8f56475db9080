"""Built-in models and the cache they are built into."""

from lmfleet.models.registry import BUILTIN_MODELS, cache_dir, resolve_source

__all__ = ["BUILTIN_MODELS", "cache_dir", "resolve_source"]
