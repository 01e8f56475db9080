"""What changing a running fleet from one ``fleet.yaml`` to another costs, key by key (``lmfleet apply``).

:func:`diff_fleets` compares two loaded fleets and returns one :class:`Change` per value that differs: its key
path (``models[smollm2].engine.max_num_seqs``; list items are named by their ``name``, cluster nodes by their
``address``), the old and new values with secrets masked (:func:`lmfleet.config.redact.redact`), where it applies
and what applying it costs:

=======================  ==================================================================================
cost                     meaning
=======================  ==================================================================================
``none``                 gateway settings read per request (providers, prices, budget, tenants, classes,
                         overflow thresholds and policies, request limits): a settings swap, no request
                         disturbed
``in place``             a Ray Serve deployment option Serve changes on running replicas (replica count,
                         autoscaling bounds, ``max_ongoing_requests``, the request router): no engine restarts
``replica replacement``  an engine option: every replica of the model is replaced by a new one
``new model``            a model added: its engines start (minutes for a large model)
``model removed``        a model removed: its application is deleted once its requests in flight end
``restart needed``       cannot change while the fleet runs (listen address and port, gateway processes,
                         ledger database, tracing, cluster layout): stop ``lmfleet serve`` and start it again
=======================  ==================================================================================

Every key of :class:`~lmfleet.config.fleet.FleetConfig` has one row in :data:`CLASSIFICATION` (a unit test walks
the schema: a new field fails until it is classified). The functions here are pure: no Ray, no files.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from lmfleet.config.fleet import FleetConfig
from lmfleet.config.redact import redact

__all__ = ["APPLIED_LIVE", "CLASSIFICATION", "COSTS", "ENGINE_KEYS", "SERVE_APPLIED", "TENANT_APPLIED", "Change", "Cost", "Where",
           "applies_live", "classify", "diff_fleets", "engine_fingerprint", "has_spend_store", "needs_restart",
           "schema_paths"]

Cost = Literal["none", "in place", "replica replacement", "new model", "model removed", "restart needed"]
Where = Literal["gateway", "serve", "engine", "cluster"]
COSTS: tuple[Cost, ...] = typing.get_args(Cost)
"""Costs from the cheapest to the dearest."""

KEYED_LISTS = {"models": "name", "providers": "name", "tenants": "name", "priority_classes": "name",
               "cluster.workers": "address"}
"""Lists whose items are matched by a key (reordering them is no change; renaming one is a removal and an add)."""

CLASSIFICATION: dict[str, tuple[Where, Cost]] = {}
"""Schema path (``models[].engine.max_num_seqs``) -> where a change of it applies and what it costs. A path ending
in ``[]`` (an item added or removed) or naming an optional section (set or unset) classifies the whole item."""


def _rows(where: Where, cost: Cost, prefix: str, names: str) -> None:
    for name in names.split():
        CLASSIFICATION[prefix + name] = (where, cost)


_rows("gateway", "none", "", "version")
# cluster layout and how Ray is reached: read when the cluster starts or is joined
_rows("cluster", "restart needed", "cluster.", "address name num_cpus head head.address head.gpus head.labels "
      "head.num_cpus workers[] workers[].address workers[].gpus workers[].labels workers[].num_cpus ssh.user "
      "ssh.key_path gpus_per_node gpu ray_port setup_commands auth_token_path launcher_path min_link_gbps")
# the listening sockets, their server options, the middleware and routes are fixed when a gateway process starts
_rows("gateway", "restart needed", "gateway.", "host port serve_port serve_proxy admin_key_env "
      "allow_unauthenticated allowed_hosts metrics_public openapi header_timeout_s keep_alive_s max_connections "
      "workers loop_stall_warn_ms health_poll_s engine_metrics_poll_s peers_period_s")
_rows("gateway", "none", "gateway.", "api_keys_env api_keys_file max_body_bytes max_prompts body_timeout_s")
_rows("gateway", "restart needed", "ledger.", "path url password_env connect_timeout_s reservation_ttl_s")
_rows("gateway", "restart needed", "observability.", "otlp_endpoint service_name sample_ratio")
_rows("gateway", "none", "budget.", "hourly_usd daily_usd on_exhausted")
_rows("gateway", "none", "providers", "[] [].name [].base_url [].model_map [].dialect "
      "[].price.input_per_1m [].price.output_per_1m [].timeouts.connect_s [].timeouts.total_s "
      "[].timeouts.first_token_s [].max_concurrency [].max_retries [].breaker.consecutive_failures "
      "[].breaker.error_rate [].breaker.window [].breaker.cooldown_s [].breaker.min_requests "
      "[].breaker.backoff_base_s [].breaker.backoff_cap_s")
# a running process's environment is fixed: a new variable name is read where the process starts
_rows("gateway", "restart needed", "providers", "[].api_key_env")
_rows("gateway", "none", "tenants", "[] [].name [].api_keys_env [].api_keys_file [].limits.requests_per_minute "
      "[].limits.tokens_per_minute [].limits.max_concurrency [].limits.hourly_usd [].limits.daily_usd [].models "
      "[].priority [].max_priority [].batch_may_use_providers")
_rows("gateway", "none", "priority_classes", "[] [].name [].order [].max_wait_s")
CLASSIFICATION["models[]"] = ("serve", "new model")  # "model removed" when the old fleet has it: see diff_fleets
_rows("engine", "replica replacement", "models[].", "name source tokenizer")
_rows("engine", "replica replacement", "models[].engine.", "device tensor_parallel_size pipeline_parallel_size "
      "data_parallel_size enable_expert_parallel all2all_backend enable_eplb expert_placement_strategy "
      "max_model_len dtype quantization kv_cache_dtype gpu_memory_utilization enable_prefix_caching "
      "enable_chunked_prefill max_num_batched_tokens max_num_seqs enforce_eager trust_remote_code "
      "cpu_kvcache_space_gib extra_args env log_metrics profiler_dir")
# Serve deployment options of kind LightWeight or NeedsActorReconfigure (ray.serve._private.config): no restart
_rows("serve", "in place", "models[].deployment.", "replicas autoscaling autoscaling.min_replicas "
      "autoscaling.max_replicas autoscaling.target_ongoing_requests autoscaling.upscale_delay_s "
      "autoscaling.downscale_delay_s max_ongoing_requests request_router prefix_aware "
      "prefix_aware.imbalance_threshold prefix_aware.match_rate_threshold prefix_aware.evict_above_chars "
      "prefix_aware.evict_to_chars prefix_aware.eviction_interval_s disaggregation.prefill.replicas "
      "disaggregation.prefill.max_ongoing_requests disaggregation.decode.replicas "
      "disaggregation.decode.max_ongoing_requests")
# the engine's own config (LLMConfig) or the replica's placement group: new replicas
_rows("engine", "replica replacement", "models[].deployment.", "stream_batching_interval_ms placement_strategy "
      "disaggregation disaggregation.prefill.engine disaggregation.decode.engine disaggregation.kv_connector "
      "disaggregation.kv_connector_options disaggregation.kv_buffer_device")
# the gateway's whole-request limit, what the ledger charges for local tokens, the overflow decision
_rows("gateway", "none", "models[].deployment.", "request_timeout_s")
_rows("gateway", "none", "models[].", "content_parts cost.gpu_hour_usd cost.node_hour_usd cost.attribution_window_s "
      "cost.min_output_tokens_per_hour")
_rows("gateway", "none", "models[].overflow.", "enabled threshold_ms hysteresis miss_quantile miss_floor "
      "providers signal_window_s cold_service_s cold_ttft_s local_first_token_timeout_s prefill_gate policy "
      "ttft_timeout_ms hedge_after_ms")

APPLIED_LIVE: frozenset[str] = frozenset({
    *(path for path in CLASSIFICATION if path.startswith("providers[]") and path != "providers[].api_key_env"),
    "models[].overflow.providers",
    "models[].overflow.threshold_ms", "models[].overflow.policy", "models[].overflow.ttft_timeout_ms",
    "models[].overflow.hedge_after_ms", "models[].overflow.enabled", "models[].overflow.hysteresis",
    "models[].overflow.cold_service_s", "models[].overflow.cold_ttft_s", "models[].overflow.prefill_gate",
    "models[].overflow.miss_floor",
    "budget.on_exhausted",
})
"""The gateway settings ``lmfleet apply`` carries out on a running fleet (a subset of the ``none`` rows: what every
gateway swaps in when the stored version moves, :mod:`lmfleet.gateway.routing.live`). :func:`applies_live` adds
the budget's caps when the running fleet has a spend store, and :data:`SERVE_APPLIED`."""

SERVE_APPLIED: frozenset[str] = frozenset(
    path for path, (_, cost) in CLASSIFICATION.items()
    if path.startswith("models[].") and path != "models[].name" and cost in ("in place", "replica replacement"))
"""A kept model's Serve and engine keys: the ``lmfleet serve`` process redeploys the model's application
(:mod:`lmfleet.serve.rollout`): ``in place`` keys keep its replicas (the deployments' version stays,
:func:`engine_fingerprint`), ``replica replacement`` keys replace them one at a time. A file that changes any key
outside these sets is refused whole: nothing changes."""

TENANT_APPLIED: frozenset[str] = frozenset({
    "tenants[].limits.requests_per_minute", "tenants[].limits.tokens_per_minute", "tenants[].limits.max_concurrency",
    "tenants[].models", "tenants[].priority", "tenants[].max_priority", "tenants[].batch_may_use_providers"})
"""A kept tenant's settings (what ``PUT /admin/tenants/NAME`` may change too): every gateway process applies them
as that API does (:class:`lmfleet.tenants.admin.TenantAdmin`), unless an operator's run-time setting holds the
tenant. A tenant added or removed, its keys, and the priority classes are not applied live."""

SPEND_CAP_KEYS = frozenset({"budget.hourly_usd", "budget.daily_usd", "tenants[].limits.hourly_usd",
                            "tenants[].limits.daily_usd"})


def has_spend_store(fleet: FleetConfig) -> bool:
    """Whether the gateways of ``fleet`` hold a spend store: it is opened at start when a USD cap is set (the
    budget's or a tenant's), and changing a cap live needs one."""
    caps = [fleet.budget, *(t.limits for t in fleet.tenants)]
    return any(c.hourly_usd is not None or c.daily_usd is not None for c in caps)


def applies_live(change: "Change", running: FleetConfig) -> bool:
    """Whether ``lmfleet apply`` carries out ``change`` on the ``running`` fleet: a key of :data:`APPLIED_LIVE`,
    :data:`SERVE_APPLIED` or :data:`TENANT_APPLIED`, a model added or removed, or a USD cap (the budget's, a tenant's) where the running
    fleet's gateways hold a spend store (:func:`has_spend_store`)."""
    return (change.schema_path in APPLIED_LIVE or change.schema_path in SERVE_APPLIED
            or change.schema_path in TENANT_APPLIED or change.schema_path == "models[]"
            or (change.schema_path in SPEND_CAP_KEYS and has_spend_store(running)))


def _section(path: str) -> bool:
    return any(other.startswith(path + ".") for other in CLASSIFICATION)


ENGINE_KEYS: tuple[str, ...] = tuple(sorted(
    path for path, (_, cost) in CLASSIFICATION.items() if path.startswith("models[].") and cost == "replica replacement"))
"""The model keys whose change replaces the model's engines: what :func:`engine_fingerprint` reads."""


def engine_fingerprint(model: BaseModel, salt: str = "") -> str:
    """A short stable hash of what a model's engines are built from (:data:`ENGINE_KEYS`: source, tokenizer, every
    engine option, the placement and the prefill/decode split; of a section that also holds ``in place`` keys, such
    as ``deployment.disaggregation``, only whether it is set). Equal for two configurations of the model that differ
    only in ``in place`` or gateway keys; Ray Serve's deployment ``version`` (``salt``: what else the engines are
    built from, e.g. lmfleet's own version)."""
    data = model.model_dump(mode="json")
    picked: dict[str, Any] = {}
    for path in ENGINE_KEYS:
        value: Any = data
        for part in path.removeprefix("models[].").split("."):
            value = value.get(part) if isinstance(value, dict) else None
        picked[path] = (value is not None) if _section(path) else value
    blob = json.dumps([salt, picked], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class Change:
    """One value that differs between the running fleet and the new file."""

    path: str
    """Where it is in the file: ``models[smollm2].deployment.replicas``, ``providers[openai]`` (added/removed)."""
    schema_path: str
    """The same key in :data:`CLASSIFICATION`'s terms: ``models[].deployment.replicas``."""
    old: Any
    """The running value, secrets masked; None when the item is added."""
    new: Any
    """The new value, secrets masked; None when the item is removed."""
    where: Where
    cost: Cost


def classify(schema_path: str) -> tuple[Where, Cost]:
    """Where a change of ``schema_path`` applies and what it costs; KeyError names a path nobody classified."""
    try:
        return CLASSIFICATION[schema_path]
    except KeyError:
        raise KeyError(f"{schema_path!r} has no row in lmfleet.config.diff.CLASSIFICATION; add one") from None


def _nested(annotation: Any) -> tuple[type[BaseModel] | None, bool, bool]:
    """(the config class inside ``annotation``, whether it is a list of them, whether it may be None)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _nested(args[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False, False
    if origin is list and args:
        cls, _, _ = _nested(args[0])
        return cls, cls is not None, False
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            cls, is_list, _ = _nested(inner[0])
            return cls, is_list, cls is not None
    return None, False, False


def schema_paths(cls: type[BaseModel] = FleetConfig, prefix: str = "") -> Iterator[str]:
    """Every key a change can name: each value, each optional section and each keyed list item."""
    for name, field in cls.model_fields.items():
        inner, is_list, optional = _nested(field.annotation)
        path = prefix + name + ("[]" if is_list else "")
        if inner is None or is_list or optional:
            yield path
        if inner is not None:
            yield from schema_paths(inner, path + ".")


def _dump(value: Any, name: str) -> Any:
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return redact(data, name)


def _change(path: str, schema_path: str, name: str, old: Any, new: Any) -> Change:
    where, cost = classify(schema_path)
    return Change(path, schema_path, _dump(old, name), _dump(new, name), where, cost)


def _diff_models(old: BaseModel, new: BaseModel, path: str, schema: str) -> Iterator[Change]:
    for name, field in type(new).model_fields.items():
        a, b = getattr(old, name), getattr(new, name)
        inner, is_list, _ = _nested(field.annotation)
        sub, sub_schema = f"{path}{name}", f"{schema}{name}"
        key = KEYED_LISTS.get((schema + name).replace("[]", "")) if is_list else None
        if key is not None:
            yield from _diff_keyed(a, b, sub, sub_schema + "[]", key)
        elif inner is not None and a is not None and b is not None and not is_list:
            yield from _diff_models(a, b, sub + ".", sub_schema + ".")
        elif _plain(a) != _plain(b):
            yield _change(sub, sub_schema, name, a, b)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _diff_keyed(old: list[Any], new: list[Any], path: str, schema: str, key: str) -> Iterator[Change]:
    before = {getattr(item, key): item for item in old}
    after = {getattr(item, key): item for item in new}
    label = path.rsplit(".", 1)[-1]
    for name, item in after.items():
        here = f"{path}[{name}]"
        if name not in before:
            yield _change(here, schema, label, None, item)
        else:
            yield from _diff_models(before[name], item, here + ".", schema + ".")
    for name, item in before.items():
        if name not in after:
            change = _change(f"{path}[{name}]", schema, label, item, None)
            if schema == "models[]":
                change = Change(change.path, schema, change.old, None, "serve", "model removed")
            yield change


def diff_fleets(old: FleetConfig, new: FleetConfig) -> list[Change]:
    """Every difference between the running fleet ``old`` and ``new``, in file order (removed items after the
    kept ones of their list); empty when nothing changes."""
    return list(_diff_models(old, new, "", ""))


def needs_restart(changes: list[Change]) -> list[Change]:
    """The changes that cannot be applied to a running fleet."""
    return [c for c in changes if c.cost == "restart needed"]
