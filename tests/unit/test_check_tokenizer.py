"""Tokenizer checks against deliberately broken tokenizers and templates (built locally, no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmfleet.check.result import Status
from lmfleet.check.tokenizer import ROUNDTRIP_TEXTS, check_tokenizer
from lmfleet.config import parse_config

GOOD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [*ROUNDTRIP_TEXTS.values(), "hello world, the quick brown fox"] * 20


def build(folder: Path, *, kind: str = "bytelevel", template: str | None = GOOD_TEMPLATE, eos: str = "<|im_end|>",
          bos: str = "<|im_start|>") -> Path:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "wordlevel":  # no byte fallback: unseen characters become [UNK]
        tok = Tokenizer(models.WordLevel(unk_token="<|endoftext|>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(["hello world"], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if kind == "lowercase":  # an old tokenizer that folds case
            tok.normalizer = normalizers.Lowercase()
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


def cfg_with(provider: bool = False):
    data = {"models": [{"name": "m", "source": "builtin:tiny-random"}]}
    if provider:
        data["providers"] = [{"name": "cloud", "base_url": "https://api.example.com/v1", "model_map": {"m": "org/model"}}]
    return parse_config(data)


def run(folder: Path, *, vocab_size: int = 400, gen_eos: int | list[int] | None = 2, bos: int | None = 1,
        provider: bool = False):
    cfg = cfg_with(provider)
    model_config = {"vocab_size": vocab_size, "eos_token_id": gen_eos, "bos_token_id": bos}
    return {r.check: r for r in check_tokenizer(cfg.models[0], cfg, str(folder), model_config=model_config,
                                                generation_config={"eos_token_id": gen_eos})}


def test_good_tokenizer_passes(tmp_path):
    results = run(build(tmp_path))
    assert {k: r.status for k, r in results.items()} == {
        "tokenizer.load": Status.PASS, "tokenizer.roundtrip": Status.PASS, "tokenizer.chat_template": Status.PASS,
        "tokenizer.stop_tokens": Status.PASS, "tokenizer.vocab": Status.PASS}
    assert "<|im_end|>" in results["tokenizer.stop_tokens"].message


# (what is broken, build kwargs, run kwargs, check id, status, text in the message)
BROKEN = [
    ("word-level, no byte fallback", {"kind": "wordlevel"}, {}, "tokenizer.roundtrip", Status.FAIL, "came back as"),
    ("case-folding normalizer", {"kind": "lowercase"}, {}, "tokenizer.roundtrip", Status.FAIL, "vietnamese"),
    ("no chat template", {"template": None}, {}, "tokenizer.chat_template", Status.FAIL, "no chat template"),
    ("template syntax error", {"template": "{% for m in messages %}{{ m['content'] }"}, {}, "tokenizer.chat_template",
     Status.FAIL, "does not render"),
    ("template raises", {"template": "{{ raise_exception('roles must alternate') }}"}, {}, "tokenizer.chat_template",
     Status.FAIL, "roles must alternate"),
    ("template drops the message", {"template": "<|im_start|>assistant\n"}, {}, "tokenizer.chat_template",
     Status.FAIL, "lost the user message"),
    ("turn ends with a token that does not stop", {"eos": "<|endoftext|>"}, {"gen_eos": 0}, "tokenizer.stop_tokens",
     Status.WARN, "answers run on to max_tokens"),
    ("eos disagrees with generation_config", {}, {"gen_eos": [0]}, "tokenizer.stop_tokens", Status.WARN,
     "is not in generation_config"),
    ("bos from an older tokenizer", {}, {"bos": 7}, "tokenizer.stop_tokens", Status.WARN, "bos_token_id"),
    ("vocabulary larger than the embedding", {}, {"vocab_size": 300}, "tokenizer.vocab", Status.FAIL,
     "embedding has 300 rows"),
]


@pytest.mark.parametrize("what,build_kw,run_kw,check,status,needle", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_tokenizers(tmp_path, what, build_kw, run_kw, check, status, needle):
    r = run(build(tmp_path, **build_kw), **run_kw)[check]
    assert r.status is status and needle in r.message, r.message
    assert r.fix


def test_missing_tokenizer_files(tmp_path):
    r = run(tmp_path)["tokenizer.load"]
    assert r.status is Status.FAIL and "cannot load a tokenizer" in r.message


def test_no_local_tokenizer_is_skipped():
    cfg = cfg_with()
    [r] = check_tokenizer(cfg.models[0], cfg, None, model_config=None, generation_config=None)
    assert r.status is Status.SKIP


def test_overflow_provider_mapping_is_shown(tmp_path):
    r = run(build(tmp_path), provider=True)["tokenizer.overflow"]
    assert r.status is Status.WARN and "m -> cloud:org/model" in r.message


def test_foreign_tokenizer_is_caught(tmp_path):
    """`tokenizer:` pointing at another checkpoint's tokenizer: it loads and round-trips, but encodes differently."""
    own = build(tmp_path / "own")
    other_corpus = ["completely different training text"] * 50
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(other_corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = GOOD_TEMPLATE
    fast.save_pretrained(tmp_path / "other")
    cfg = cfg_with()
    results = {r.check: r for r in check_tokenizer(
        cfg.models[0], cfg, str(tmp_path / "other"), model_config={"vocab_size": 400, "eos_token_id": 2, "bos_token_id": 1},
        generation_config={"eos_token_id": 2}, reference_location=str(own))}
    assert results["tokenizer.roundtrip"].status is Status.PASS  # byte-level: round-trips anyway
    r = results["tokenizer.matches_checkpoint"]
    assert r.status is Status.FAIL and "encodes text differently" in r.message
    same = {r.check: r for r in check_tokenizer(cfg.models[0], cfg, str(own), model_config={"vocab_size": 400},
                                                generation_config=None, reference_location=str(tmp_path / "own"))}
    assert "tokenizer.matches_checkpoint" not in same  # same folder: nothing to compare
