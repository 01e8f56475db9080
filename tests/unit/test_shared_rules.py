"""The rules kept in one place: provenance labels, money in nano-dollars, the tokenizer loader."""

from __future__ import annotations

import pytest

from lmfleet.models.tokenizer import TokenizerLoadError, load_tokenizer
from lmfleet.overflow.money import NUSD_PER_USD, nusd_to_usd, usd_to_nusd
from lmfleet.provenance import is_external, local_label, provider_label


@pytest.mark.parametrize("build, name, label, external", [
    (local_label, "smollm2", "local/smollm2", False),
    (provider_label, "acme", "provider/acme", True),
    (provider_label, "with/slash", "provider/with/slash", True),
    (local_label, "org/model", "local/org/model", False),
])
def test_labels(build, name, label, external):
    assert build(name) == label
    assert is_external(label) is external


@pytest.mark.parametrize("label", ["smollm2", "local/x", "remote/x", "", "Provider/x"])
def test_only_provider_labels_are_external(label):
    assert not is_external(label)


@pytest.mark.parametrize("usd, nusd", [
    (0.0, 0), (1.0, NUSD_PER_USD), (0.000013, 13_000), (1e-10, 0), (6e-10, 1), (0.6, 600_000_000),
    (123.456789012, 123_456_789_012),
])
def test_usd_nusd(usd, nusd):
    assert usd_to_nusd(usd) == nusd and isinstance(usd_to_nusd(usd), int)
    assert nusd_to_usd(nusd) == pytest.approx(usd, abs=5e-10)


def test_rolling_sums_are_exact_in_nano_dollars():
    """1.8 - 0.4 - 0.4 is 1.0000000000000002 in floats; in nano-dollars it is exact."""
    assert nusd_to_usd(usd_to_nusd(1.8) - usd_to_nusd(0.4) - usd_to_nusd(0.4)) == 1.0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                                        special_tokens=["<eos>"]))
    folder = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return folder


def test_load_tokenizer_from_a_folder(tokenizer_dir):
    tok = load_tokenizer(str(tokenizer_dir))
    assert tok.eos_token == "<eos>" and tok.encode("hello world")


@pytest.mark.parametrize("location, local_only, needle", [
    ("{tmp}/missing", True, "offline"),
    ("{tmp}", True, "offline"),  # a folder without tokenizer files
    ("no-such-org/no-such-model-xyz", True, "no-such-org/no-such-model-xyz"),  # a hub id, offline
])
def test_load_tokenizer_failures_are_one_error(tmp_path, location, local_only, needle):
    with pytest.raises(TokenizerLoadError, match="cannot load a tokenizer from") as info:
        load_tokenizer(location.format(tmp=tmp_path), local_files_only=local_only)
    assert needle in str(info.value) and info.value.__cause__ is not None


def test_bench_uses_the_loader(tokenizer_dir, tmp_path):
    from lmfleet.bench.runner import load_bench_tokenizer
    from lmfleet.bench.workload import BenchInputError

    assert load_bench_tokenizer(str(tokenizer_dir), trust_remote_code=True).eos_token == "<eos>"
    with pytest.raises(BenchInputError, match="cannot load tokenizer"):
        load_bench_tokenizer(str(tmp_path / "missing"))
