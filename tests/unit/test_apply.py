"""``lmfleet apply``: the running fleet's store (versions, races), the command (diff, --dry-run, refusals, an
invalid file), the gateways' view of the version (``/admin/state``). Ray's GCS is replaced by :class:`MemoryKV`
at the CLI's one boundary (``open_store``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lmfleet.cli import apply as apply_cli
from lmfleet.cli.main import app
from lmfleet.cluster.fleet_store import FleetStore, MemoryKV, VersionConflict
from lmfleet.config import load_config, parse_config
from lmfleet.gateway.routing.fleet_watch import FleetWatch
from lmfleet.testing.gateway_fakes import make_gateway, started_client

BASE: dict[str, Any] = {
    "models": [{"name": "m", "source": "builtin:tiny-random", "overflow": {"providers": ["p"]}}],
    "providers": [{"name": "p", "base_url": "https://api.example.com/v1", "model_map": {"m": "pm"},
                   "price": {"input_per_1m": 1.0, "output_per_1m": 2.0}}],
}


def fleet_with(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data.update(changes)
    return data


# ------------------------------------------------------------------------------------------------ the store
def test_store_round_trips_a_fleet_and_numbers_versions() -> None:
    store = FleetStore(MemoryKV(), clock=lambda: 100.0)
    assert store.current_version() is None and store.read() is None
    default = load_config(None)
    first = store.publish(default, source="serve")
    assert (first.version, store.current_version()) == (1, 1)
    assert store.read().fleet == default and store.read().source == "serve"
    second = store.write(parse_config(BASE), source="apply f.yaml", expected=1)
    assert second.version == 2 and store.read().fleet == parse_config(BASE)
    assert store.read(1).fleet == default  # earlier versions stay readable
    assert store.publish(default, source="serve again").version == 3  # a restart continues the numbering


def test_store_refuses_a_change_computed_against_an_old_version() -> None:
    store = FleetStore(MemoryKV())
    store.publish(parse_config(BASE), source="serve")
    store.write(parse_config(BASE), source="apply a", expected=1)
    with pytest.raises(VersionConflict, match="version 2, not 1"):
        store.write(parse_config(BASE), source="apply b", expected=1)
    assert store.current_version() == 2


def test_store_two_writers_racing_for_one_number_cannot_both_win() -> None:
    kv = MemoryKV()
    store = FleetStore(kv)
    store.publish(parse_config(BASE), source="serve")
    kv.put("fleet/v2", b"{}", overwrite=False)  # the other writer's record landed between our read and our put
    with pytest.raises(VersionConflict, match="version 2 .* just written"):
        store.write(parse_config(BASE), source="apply", expected=1)
    assert store.current_version() == 1


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> FleetStore:
    running = FleetStore(MemoryKV())
    running.publish(parse_config(BASE), source="serve fleet.yaml")
    monkeypatch.setattr(apply_cli, "open_store", lambda address, fleet: running)
    return running


def run_apply(tmp_path: Path, data: Any, *flags: str) -> Any:
    path = tmp_path / "fleet.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return CliRunner().invoke(app, ["apply", "-c", str(path), *flags])


def test_dry_run_prints_each_change_and_changes_nothing(tmp_path: Path, store: FleetStore) -> None:
    new = fleet_with(budget={"hourly_usd": 5.0})
    new["models"][0]["deployment"] = {"replicas": 2}
    new["providers"][0]["price"]["input_per_1m"] = 3.0
    result = run_apply(tmp_path, new, "--dry-run")
    assert result.exit_code == 0, result.output
    for text in ("models[m].deployment.replicas", "in place", "providers[p].price.input_per_1m", "budget.hourly_usd",
                 "version 1", "dry run: 3 change(s)"):
        assert text in result.output
    assert store.current_version() == 1


def test_keys_applied_live_are_stored_as_the_next_version(tmp_path: Path, store: FleetStore) -> None:
    new = fleet_with()
    new["providers"][0]["price"]["output_per_1m"] = 4.0
    new["models"][0]["overflow"]["threshold_ms"] = 900.0
    result = run_apply(tmp_path, new)
    assert result.exit_code == 0, result.output
    assert "now version 2" in result.output
    assert store.read().fleet == parse_config(new) and store.read().source.startswith("apply ")


@pytest.mark.parametrize(("changes", "refused_key"), [
    ({}, "budget.daily_usd (none)"),  # a gateway setting not taken live yet
    ({"gateway": {"port": 9000}}, "gateway.port (restart needed)"),
    ({"providers": [{"name": "p", "base_url": "https://api.example.com/v1", "model_map": {"m": "pm"},
                     "api_key_env": "OTHER", "price": {"input_per_1m": 1.0, "output_per_1m": 2.0}}]},
     "providers[p].api_key_env (restart needed)"),
    ({"tenants": [{"name": "t", "api_keys_env": "T_KEYS"}]}, "tenants[t] (none)"),
])
def test_changes_that_cannot_be_applied_live_change_nothing(tmp_path: Path, store: FleetStore,
                                                            changes: dict, refused_key: str) -> None:
    result = run_apply(tmp_path, fleet_with(budget={"daily_usd": 1.0}, **changes))
    assert result.exit_code == 1
    assert refused_key in result.output and "nothing changed" in result.output
    assert store.current_version() == 1


def test_a_budget_cap_applies_where_the_running_fleet_has_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    running = FleetStore(MemoryKV())
    running.publish(parse_config(fleet_with(budget={"daily_usd": 50.0})), source="serve fleet.yaml")
    monkeypatch.setattr(apply_cli, "open_store", lambda address, fleet: running)
    result = run_apply(tmp_path, fleet_with(budget={"daily_usd": 20.0, "hourly_usd": 2.0}))
    assert result.exit_code == 0, result.output
    assert running.read().fleet.budget.hourly_usd == 2.0


def test_no_change(tmp_path: Path, store: FleetStore) -> None:
    result = run_apply(tmp_path, BASE)
    assert result.exit_code == 0 and "no change from the running fleet (version 1)" in result.output


def test_an_invalid_file_changes_nothing_and_says_what_is_wrong(tmp_path: Path, store: FleetStore) -> None:
    result = run_apply(tmp_path, fleet_with(budget={"hourly_usd": -1}))
    assert result.exit_code == 2
    assert "budget.hourly_usd" in result.output
    assert store.current_version() == 1


def test_a_cluster_without_a_stored_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apply_cli, "open_store", lambda address, fleet: FleetStore(MemoryKV()))
    result = run_apply(tmp_path, BASE, "--dry-run")
    assert result.exit_code == 1 and "holds no running fleet" in result.output


@pytest.mark.parametrize("error", [ConnectionError("Could not find any running Ray instance."),
                                   RuntimeError("Timed out while waiting for GCS to become available.")])
def test_a_cluster_that_cannot_be_reached_exits_1_naming_the_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      error: Exception) -> None:
    """Ray's GCS client raises ConnectionError (no cluster found here) or its own RPC errors (none answers)."""
    import lmfleet.ray_private as rp

    def unreachable(address):
        raise error

    monkeypatch.setattr(rp, "gcs_client", unreachable)
    monkeypatch.setattr("lmfleet.cluster.connect.check_reachable", lambda address: None)  # Ray's client's turn
    monkeypatch.setattr("lmfleet.cluster.join.present_ray_token", lambda: None)  # leaves os.environ alone
    result = run_apply(tmp_path, BASE, "--dry-run", "--address", "10.0.0.9:6379")
    assert result.exit_code == 1, result.output
    assert "cannot reach the Ray cluster at 10.0.0.9:6379" in result.output and str(error) in result.output


def test_secrets_never_echo_in_the_table(tmp_path: Path, store: FleetStore) -> None:
    secret = "supersecret123"
    new = fleet_with(cluster={"setup_commands": [f"export HF_TOKEN={secret}"]})
    result = run_apply(tmp_path, new, "--dry-run")
    assert result.exit_code == 0 and secret not in result.output and "HF_TOKEN=***" in result.output


# ------------------------------------------------------------------------------------------------ the gateways
async def test_fleet_watch_follows_the_stored_version() -> None:
    versions = iter([None, 1, 1, 2, RuntimeError("GCS restarting"), 3])
    seen: list[int] = []

    def read() -> int | None:
        v = next(versions)
        if isinstance(v, Exception):
            raise v
        return v

    async def on_version(v: int) -> None:
        seen.append(v)

    watch = FleetWatch(read, on_version=on_version)
    assert [await watch.poll_once() for _ in range(6)] == [None, 1, 1, 2, 2, 3]
    assert seen == [1, 2, 3]  # the first one too: a process started from its own file converges


async def test_fleet_watch_keeps_its_version_when_taking_a_new_one_fails() -> None:
    async def broken(v: int) -> None:
        raise ValueError("stored fleet does not load")

    watch = FleetWatch(lambda: 2, on_version=broken)
    assert await watch.poll_once() is None and watch.version is None  # tried again at the next poll


async def test_admin_state_shows_the_fleet_version(tmp_path: Path) -> None:
    app_ = make_gateway(tmp_path, lambda request: None)
    client = await started_client(app_)
    admin = {"authorization": "Bearer adm"}
    assert (await client.get("/admin/state", headers=admin)).json()["fleet_version"] is None
    app_.state.gateway.fleet_watch = watch = FleetWatch(lambda: 4)
    await watch.poll_once()
    assert (await client.get("/admin/state", headers=admin)).json()["fleet_version"] == 4


@pytest.mark.parametrize(("deployment", "engine", "said"), [
    ({"replicas": 2}, {}, "m (in place)"),
    ({"replicas": 2}, {"max_num_seqs": 8}, "m (replica replacement)"),
    ({}, {"max_num_seqs": 8}, "m (replica replacement)"),
    (None, {}, "n (new model)"),
    (None, None, "m (model removed)"),
])
def test_serve_side_changes_are_stored_for_the_serve_process_to_redeploy(tmp_path: Path, store: FleetStore,
                                                                        deployment: dict, engine: dict,
                                                                        said: str) -> None:
    new = fleet_with()
    if deployment is not None:
        new["models"][0].update(deployment=deployment, engine=engine)
    elif engine is not None:  # a model added
        new["models"].append({"name": "n", "source": "builtin:tiny-random"})
    else:  # the only model removed, another added in its place
        new["models"] = [{"name": "n", "source": "builtin:tiny-random"}]
        new["providers"][0]["model_map"] = {"n": "pn"}
    result = run_apply(tmp_path, new)
    assert result.exit_code == 0, result.output
    assert "now version 2" in result.output and said in result.output
    assert store.read().fleet == parse_config(new)


def test_dry_run_says_what_serve_would_deploy(tmp_path: Path, store: FleetStore) -> None:
    new = fleet_with()
    new["models"][0]["engine"] = {"max_num_seqs": 8}
    result = run_apply(tmp_path, new, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "replica replacement" in result.output
    assert "dry run: 1 change(s); Serve would deploy: m (replica replacement); nothing changed" in result.output
    assert store.current_version() == 1
