"""Models that are a local folder skip Ray Serve LLM's per-node download task."""

from __future__ import annotations

import asyncio

import pytest

from lmfleet.config.models import ModelConfig
from lmfleet.engine.app import LOCAL_FOLDER_INIT, llm_config_kwargs


@pytest.mark.parametrize("folder, expected", [(True, {"callback_class": LOCAL_FOLDER_INIT}), (False, None)])
def test_callback_only_for_local_folders(tmp_path, folder, expected):
    m = ModelConfig(name="m", source="x")
    path = str(tmp_path) if folder else "org/hub-model"
    assert llm_config_kwargs(m, path).get("callback_config") == expected


def test_ray_serve_llm_takes_the_callback_and_skips_node_init(tmp_path):
    from ray.llm._internal.common.utils.import_utils import load_class
    from ray.serve.llm import LLMConfig

    (tmp_path / "config.json").write_text("{}")
    cfg = LLMConfig(**llm_config_kwargs(ModelConfig(name="m", source="x", engine={"device": "cpu"}), str(tmp_path)))
    cb = load_class(cfg.callback_config.callback_class)(llm_config=cfg)  # as the replica builds it, minus Ray
    asyncio.run(cb.run_callback("on_before_node_init"))
    assert cb.ctx.run_init_node is False
