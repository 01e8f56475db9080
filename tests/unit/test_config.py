"""Config validation: tables of good and bad fleet files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmfleet.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
MIN = {"models": [{"name": "m", "source": "builtin:tiny-random"}]}


def _with(path: str, value) -> dict:
    data = json.loads(json.dumps(MIN))
    cur = data
    keys = path.split(".")
    for k in keys[:-1]:
        k = int(k) if k.isdigit() else k
        if isinstance(cur, dict):
            cur = cur.setdefault(k, {})
        else:
            cur = cur[k]
    cur[keys[-1]] = value
    return data


GOOD = [
    MIN,
    _with("models.0.engine", {"tensor_parallel_size": 8, "pipeline_parallel_size": 4, "quantization": "fp8",
                              "max_model_len": 16384, "enable_prefix_caching": True, "enable_chunked_prefill": True,
                              "max_num_batched_tokens": 8192, "extra_args": {"swap_space": 4}}),
    _with("models.0.deployment", {"autoscaling": {"min_replicas": 2, "max_replicas": 8, "upscale_delay_s": 30}}),
    _with("gateway", {"host": "0.0.0.0", "port": 9000, "api_keys_env": "MY_KEYS"}),
]

BAD = [
    # (data, key path in message, words in message)
    (_with("models.0.deployment", {"autoscaling": {" upscale_delay_s": 3}}), '" upscale_delay_s"', "did you mean 'upscale_delay_s'"),
    (_with("models.0.engine", {"tensor_parallel_size": 0}), "models[0].engine.tensor_parallel_size", "greater than or equal to 1"),
    (_with("models.0.engine", {"gpu_memory_utilization": 1.5}), "gpu_memory_utilization", "less than or equal to 1"),
    (_with("models.0.engine", {"quantization": "int3"}), "models[0].engine.quantization", "fp8"),
    (_with("models.0.engine", {"extra_args": {"max_model_len": 5}}), "extra_args", "repeats typed engine options"),
    (_with("models.0.engine", {"env": {"NCCL DEBUG": "INFO"}}), "models[0].engine.env", "NCCL DEBUG"),
    (_with("models.0.engine", {"env": {"VLLM_CPU_KVCACHE_SPACE": "4"}}), "models[0].engine.env", "cpu_kvcache_space_gib"),
    (_with("models.0.engine", {"env": {"NCCL_DEBUG": 3}}), "models[0].engine.env.NCCL_DEBUG", "string"),
    (_with("models.0.deployment", {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}), "autoscaling", "min_replicas=5"),
    (_with("models.0.source", "builtin:nope"), "models[0].source", "unknown builtin model"),
    (_with("models.0.name", "bad name!"), "models[0].name", "pattern"),
    ({"models": []}, "models", "at least 1"),
    ({"modles": []}, "modles", "unknown key"),
    ({"models": [MIN["models"][0], MIN["models"][0]]}, "(top level)", "unique"),
    (_with("gateway", {"port": 70000}), "gateway.port", "less than or equal to 65535"),
    ({**MIN, "providers": [{"name": "p", "base_url": "http://x/v1", "model_map": {"other": "y"}}]}, "provider 'p'", "unknown local models"),
    ({**MIN, "providers": [{"name": "p", "base_url": "ftp://x", "model_map": {"m": "y"}}]}, "providers[0].base_url", "pattern"),
    ({**MIN, "providers": [{"name": "p", "base_url": "http://x/v1", "model_map": {"m": "y"}, "api_key": "sk-1"}]},
     "providers[0].api_key", "unknown key"),
]


@pytest.mark.parametrize("data", GOOD)
def test_good_configs(data):
    assert parse_config(data).models[0].name == "m"


@pytest.mark.parametrize("data,path,words", BAD)
def test_bad_configs_name_path_and_expectation(data, path, words):
    with pytest.raises(ConfigError) as ei:
        parse_config(data, "fleet.yaml")
    msg = str(ei.value)
    assert msg.startswith("fleet.yaml: invalid fleet config")
    assert path in msg, msg
    assert words in msg, msg


def test_line_numbers_from_yaml(tmp_path):
    p = tmp_path / "fleet.yaml"
    p.write_text("models:\n  - name: m\n    source: builtin:tiny-random\n    deployment:\n      autoscaling:\n"
                 "        ' upscale_delay_s': 3\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "line 6" in str(ei.value) and str(p) in str(ei.value)


@pytest.mark.parametrize("text,words", [("", "empty"), ("- a\n- b\n", "mapping"), ("models: [\n", "not valid YAML")])
def test_unparseable(tmp_path, text, words):
    p = tmp_path / "f.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")


def test_embedded_default_is_valid():
    cfg = load_config(None)
    assert cfg.models[0].source == "builtin:smollm2"
    assert cfg.gateway.host == "127.0.0.1"


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    load_config(path)


def test_cli_validate_exit_code_and_schema(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(BAD[0][0]))
    r = subprocess.run([sys.executable, "-m", "lmfleet.cli.main", "config", "validate", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "upscale_delay_s" in r.stderr and str(bad) in r.stderr
    r = subprocess.run([sys.executable, "-m", "lmfleet.cli.main", "config", "schema"], capture_output=True, text=True)
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    assert "models" in schema["properties"]


def test_engine_kwargs_passthrough():
    cfg = parse_config(_with("models.0.engine", {"max_model_len": 512, "extra_args": {"swap_space": 2},
                                                 "cpu_kvcache_space_gib": 1}))
    kw = cfg.models[0].engine.vllm_kwargs()
    assert kw["max_model_len"] == 512 and kw["swap_space"] == 2
    assert "cpu_kvcache_space_gib" not in kw and "extra_args" not in kw and "device" not in kw


def test_engine_env_reaches_the_engine_processes():
    from lmfleet.engine.app import engine_env

    cfg = parse_config(_with("models.0.engine", {"cpu_kvcache_space_gib": 2,
                                                 "env": {"VLLM_CPU_OMP_THREADS_BIND": "1", "NCCL_DEBUG": "WARN"}}))
    assert "env" not in cfg.models[0].engine.vllm_kwargs()
    env = engine_env(cfg.models[0])
    env.pop("LD_PRELOAD", None)  # tcmalloc where this machine has it (tests/unit/test_engine_env.py)
    env.pop("VLLM_USE_AOT_COMPILE", None)  # on a CPU engine (tests/unit/test_engine_env.py)
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "1", "NCCL_DEBUG": "WARN", "VLLM_CPU_KVCACHE_SPACE": "2"}


@pytest.mark.parametrize("dtype, expected", [(None, "float32"), ("auto", "float32"), ("bfloat16", "bfloat16")])
def test_builtin_smollm2_runs_in_float32_unless_told_otherwise(dtype, expected):
    # vLLM's CPU build picks bfloat16 for "auto" where the CPU supports it, and the converted SmolLM2 then
    # answers nonsense: the built-in model's own default makes the answer the same on every machine
    model = {"name": "s", "source": "builtin:smollm2"}
    if dtype is not None:
        model["engine"] = {"dtype": dtype}
    assert parse_config({"models": [model]}).models[0].engine.dtype == expected
    assert parse_config(MIN).models[0].engine.dtype == "auto"  # other models keep vLLM's choice
