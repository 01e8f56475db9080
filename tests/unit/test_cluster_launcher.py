"""The `ray up` file and manual commands generated from `cluster:`, checked against Ray's own schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
from typer.testing import CliRunner

from lmfleet.cluster.launcher import LauncherError, launcher_config, launcher_warnings, manual_commands
from lmfleet.config.models import ClusterConfig

RAY_SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _cluster(**kw) -> ClusterConfig:
    base = {"head": {"address": "10.0.0.1"}, "workers": [{"address": "10.0.0.2"}, {"address": "10.0.0.3"}]}
    return ClusterConfig.model_validate({**base, **kw})


CASES = [
    pytest.param({}, id="minimal"),
    pytest.param({"gpus_per_node": 8, "ray_port": 6380, "setup_commands": ["pip install lmfleet"]}, id="gpus-port-setup"),
    pytest.param({"ssh": {"user": "root", "key_path": "/keys/fleet"}, "name": "prod-1"}, id="ssh"),
    pytest.param(
        {"workers": [{"address": "10.0.0.2", "gpus": 4, "labels": {"zone": "a"}},
                     {"address": "10.0.0.3", "gpus": 4, "labels": {"zone": "a"}}]},
        id="shared-worker-settings",
    ),
    pytest.param({"workers": []}, id="head-only"),
]


@pytest.mark.parametrize("overrides", CASES)
def test_launcher_file_is_valid_for_ray(overrides):
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = launcher_config(_cluster(**overrides))
    jsonschema.validate(cfg, RAY_SCHEMA)
    validate_config(prepare_config(copy.deepcopy(cfg)))  # Ray's own fill-in + check, as `ray up` does


@pytest.mark.parametrize(
    ("overrides", "head_has", "worker_has"),
    [
        ({}, ["--head", "--port=6379"], ["--address=$RAY_HEAD_IP:6379"]),
        ({"ray_port": 7000}, ["--port=7000"], ["--address=$RAY_HEAD_IP:7000"]),
        ({"gpus_per_node": 8}, ["--num-gpus=8"], ["--num-gpus=8"]),
        ({"head": {"address": "10.0.0.1", "gpus": 0, "num_cpus": 4}}, ["--num-gpus=0", "--num-cpus=4"], []),
        ({"workers": [{"address": "10.0.0.2", "labels": {"zone": "b", "tier": "x"}}]}, [], ["--labels=tier=x,zone=b"]),
    ],
)
def test_start_commands(overrides, head_has, worker_has):
    cfg = launcher_config(_cluster(**overrides))
    head, worker = cfg["head_start_ray_commands"][-1], cfg["worker_start_ray_commands"][-1]
    assert head.startswith("RAY_AUTH_MODE=token ray start") and worker.startswith("RAY_AUTH_MODE=token ray start")
    for arg in head_has:
        assert arg in head.split()
    for arg in worker_has:
        assert arg in worker.split()


def test_token_is_mounted_not_inlined(tmp_path):
    token_file = tmp_path / "tok"
    token_file.write_text("s3cret-token-value")
    cfg = launcher_config(_cluster(auth_token_path=str(token_file)))
    assert cfg["file_mounts"] == {"~/.ray/auth_token": str(token_file)}
    assert "s3cret-token-value" not in json.dumps(cfg)
    assert "s3cret-token-value" not in "\n".join(manual_commands(_cluster(auth_token_path=str(token_file))))


def test_provider_addresses_and_auth():
    cfg = launcher_config(_cluster(ssh={"user": "ops", "key_path": "~/.ssh/k"}))
    assert cfg["provider"] == {"type": "local", "head_ip": "10.0.0.1", "worker_ips": ["10.0.0.2", "10.0.0.3"]}
    assert cfg["auth"] == {"ssh_user": "ops", "ssh_private_key": "~/.ssh/k"}
    assert cfg["max_workers"] == 2


def test_no_head_is_explained():
    with pytest.raises(LauncherError, match="cluster.head is not set"):
        launcher_config(ClusterConfig())


@pytest.mark.parametrize(
    ("workers", "warned"),
    [
        ([{"address": "a", "gpus": 8}, {"address": "b", "gpus": 8}], []),
        ([{"address": "a", "gpus": 8}, {"address": "b", "gpus": 4}], ["gpus"]),
        ([{"address": "a", "labels": {"z": "1"}}, {"address": "b"}], ["labels"]),
    ],
)
def test_per_worker_differences_are_warned(workers, warned):
    msgs = launcher_warnings(_cluster(workers=workers))
    assert [m.split("'")[1] for m in msgs] == warned


def test_manual_commands_cover_every_node():
    lines = manual_commands(_cluster(gpus_per_node=8))
    text = "\n".join(lines)
    assert "ray start --head --port=6379 --num-gpus=8 --node-ip-address=10.0.0.1" in text
    for ip in ("10.0.0.2", "10.0.0.3"):
        assert f"RAY_AUTH_MODE=token ray start --address=10.0.0.1:6379 --num-gpus=8 --node-ip-address={ip}" in text
        assert f"@{ip} 'mkdir -p ~/.ray && umask 077 && cat > ~/.ray/auth_token' < ~/.ray/auth_token" in text
    assert "lmfleet serve -c fleet.yaml --address 10.0.0.1:6379" in text


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"head": {"address": "a"}, "workers": [{"address": "a"}]}, "must be distinct"),
        ({"workers": [{"address": "b"}]}, "cluster.head is not"),
        ({"head": {"address": "a", "labels": {"bad key": "v"}}}, "node labels"),
        ({"head": {"address": "a", "labels": {"k": "a,b"}}}, "node labels"),
    ],
)
def test_cluster_config_errors(cluster, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.model_validate(cluster)


def test_cli_up_print_runs_nothing(tmp_path):
    from lmfleet.cli.main import app

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "cluster:\n  head: {address: 10.0.0.1}\n  workers: [{address: 10.0.0.2}]\n  gpus_per_node: 2\n"
        "  auth_token_path: " + str(tmp_path / "never-created") + "\n"
        "models:\n  - {name: m, source: builtin:tiny-random, engine: {tensor_parallel_size: 2}, deployment: {replicas: 2}}\n"
    )
    r = CliRunner().invoke(app, ["cluster", "up", "-c", str(fleet), "--print"])
    assert r.exit_code == 0, r.output
    assert "cluster_name: lmfleet" in r.output and "ray start --head" in r.output
    assert "10.0.0.1: m#0" in r.output and "10.0.0.2: m#1" in r.output
    assert not (tmp_path / "never-created").exists()
