"""The embedded default's generation_config.json: greedy by default in vLLM, valid for transformers, and caches
built before it existed are rebuilt (issue 16: the README's question answered right at default settings)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lmfleet.models import _atomic
from lmfleet.models import smollm2 as smol


def _write(folder, gen: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(gen))


def vllm_defaults(folder) -> dict:
    """The default sampling parameters vLLM's OpenAI server takes from ``folder`` (``--generation-config auto``),
    through vLLM's own ModelConfig.get_diff_sampling_param."""
    from vllm.config.model import ModelConfig
    from vllm.transformers_utils.config import try_get_generation_config

    def from_folder() -> dict:
        return try_get_generation_config(str(folder), False).to_diff_dict()

    stub = SimpleNamespace(generation_config="auto", override_generation_config={},
                           try_get_generation_config=from_folder)
    return ModelConfig.get_diff_sampling_param(stub)


def test_vllm_applies_greedy_default_and_nothing_else(tmp_path):
    _write(tmp_path, smol.generation_config())
    assert vllm_defaults(tmp_path) == {"temperature": 0.0}


def test_transformers_reads_it_as_greedy(tmp_path):
    from transformers import GenerationConfig

    _write(tmp_path, smol.generation_config())
    gen = GenerationConfig.from_pretrained(tmp_path)
    assert gen.do_sample is False  # transformers decodes greedily and ignores the temperature
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)


@pytest.mark.parametrize("mark,version,complete", [
    (None, smol.BUILD_VERSION, False),           # never built
    ("ok\n", smol.BUILD_VERSION, False),         # built by an lmfleet before versioned builds: rebuild
    ("smollm2-1\n", smol.BUILD_VERSION, False),  # an older version
    (f"{smol.BUILD_VERSION}\n", smol.BUILD_VERSION, True),
    ("ok\n", _atomic.UNVERSIONED, True),         # unversioned builders (the tiny model) keep working
])
def test_completion_mark_carries_the_build_version(tmp_path, mark, version, complete):
    dest = tmp_path / "m"
    dest.mkdir()
    if mark is not None:
        (dest / _atomic.DONE_MARK).write_text(mark)
    assert _atomic.is_complete(dest, version) is complete


def test_an_outdated_build_is_replaced(tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "stale.txt").write_text("old")
    (dest / _atomic.DONE_MARK).write_text("ok\n")
    with _atomic.building(dest, "v2") as tmp:
        assert tmp is not None
        (tmp / "new.txt").write_text("new")
    assert _atomic.is_complete(dest, "v2") and (dest / "new.txt").exists() and not (dest / "stale.txt").exists()
    with _atomic.building(dest, "v2") as tmp:
        assert tmp is None  # already current: nothing to do


def test_ensure_smollm2_reuses_a_current_build_without_converting(tmp_path, monkeypatch):
    dest = tmp_path / "smol"
    dest.mkdir()
    (dest / _atomic.DONE_MARK).write_text(f"{smol.BUILD_VERSION}\n")
    monkeypatch.setattr(smol, "convert_gguf", lambda *a: pytest.fail("converted a current build"))
    assert smol.ensure_smollm2(dest, progress=lambda _m: None) == dest
