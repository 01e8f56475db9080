"""Ray Serve LLM's node initialization, skipped for models that are already a local folder.

Before an engine starts, Ray Serve LLM runs one task per node of the replica's placement group to download the
model; that task starts a fresh Ray worker process that imports Ray Serve LLM (seconds of CPU on a small machine,
while the engine itself is loading). For a folder on disk there is nothing to download, so lmfleet's deployments
of such models use :class:`LocalFolderInit`, which tells Ray Serve LLM not to run that task.
"""

from __future__ import annotations

from ray.llm._internal.common.callbacks.base import CallbackBase

__all__ = ["LocalFolderInit"]


class LocalFolderInit(CallbackBase):
    """Ray Serve LLM callback: no per-node download task (the model is a folder present on the node)."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False
