"""Build one Ray Serve application per model with ``ray.serve.llm``.

Each model gets its own application (``lmfleet-<slug>``) under its own route prefix on Serve's
loopback HTTP proxy, so one model's engine dying or redeploying never touches the others, and
``serve.status()`` reports health per model. The gateway forwards to ``<serve_url>/<slug>/v1/...``.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

from lmfleet import ray_private
from lmfleet.cluster.placement import serve_placement
from lmfleet.config.diff import engine_fingerprint
from lmfleet.config.models import DeploymentConfig, FleetConfig, ModelConfig
from lmfleet.engine.routing import check_router_available, request_router_config
from lmfleet.models import resolve_source
from lmfleet.overflow.cost import local_hourly_cost_usd
from lmfleet.overflow.estimator import local_capacity


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower() or "model"


def model_app_name(name: str) -> str:
    return f"lmfleet-{_slug(name)}"


def model_route_prefix(name: str) -> str:
    return f"/{_slug(name)}"


@dataclass(frozen=True)
class ModelApp:
    """One model as deployed, resolved once from the fleet file: what the gateway and the deployer read.

    Derived values (context length, capacity, device, hourly cost) are computed here and nowhere else.
    """

    cfg: ModelConfig = field(repr=False)
    name: str
    app_name: str
    route_prefix: str
    model_path: str
    tokenizer_path: str
    max_model_len: int | None
    """Context length: engine.max_model_len, else the checkpoint's max_position_embeddings (None: unknown)."""
    capacity: int
    """Requests the deployment runs at once (see :func:`lmfleet.overflow.estimator.local_capacity`)."""
    device: str
    """``cpu`` or ``gpu`` (see :func:`engine_device`)."""
    hourly_cost_usd: float
    """What the deployment costs per hour at its configured replica count (for the ledger)."""
    llm_config: Any = field(default=None, repr=False)
    """``ray.serve.llm.LLMConfig`` (None where nothing is deployed, e.g. gateway tests)."""
    prefill_llm_config: Any = field(default=None, repr=False)
    """The prefill pool's ``LLMConfig`` when deployment.disaggregation is set (``llm_config`` is then the decode
    pool's); None otherwise."""

    @property
    def threshold_ms(self) -> float:
        return self.cfg.overflow.threshold_ms

    def base_url(self, serve_url: str) -> str:
        """The model's OpenAI base URL behind Serve's HTTP front at ``serve_url``."""
        return f"{serve_url.rstrip('/')}{self.route_prefix}/v1"


def model_max_len(model: ModelConfig, model_path: str) -> int | None:
    if model.engine.max_model_len:
        return model.engine.max_model_len
    with contextlib.suppress(OSError, ValueError):
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        return cfg.get("max_position_embeddings")
    return None


def resolve_model(model: ModelConfig, model_path: str, tokenizer_path: str | None = None,
                  llm_config: Any = None) -> ModelApp:
    """The resolved record of one model whose weights are at ``model_path`` (no Ray needed)."""
    device = engine_device(model)
    return ModelApp(model, model.name, model_app_name(model.name), model_route_prefix(model.name), model_path,
                    tokenizer_path or model_path, model_max_len(model, model_path), local_capacity(model), device,
                    local_hourly_cost_usd(model, uses_gpus=device == "gpu"), llm_config)


def serve_deployment_options(dep: DeploymentConfig) -> dict[str, Any]:
    """Ray Serve deployment options from our deployment section."""
    opts: dict[str, Any] = {"max_ongoing_requests": dep.max_ongoing_requests}
    if dep.autoscaling is not None:
        a = dep.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
        }
    else:
        opts["num_replicas"] = dep.replicas or 1
    router = request_router_config(dep)
    if router is not None:
        opts["request_router_config"] = router
    return opts


TCMALLOC_PATTERNS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
"""Where Debian's ``libtcmalloc-minimal4`` (and RPM distributions' gperftools-libs) put tcmalloc."""


def find_tcmalloc() -> str | None:
    """This node's tcmalloc library, if installed (``make install`` installs Debian's where it may)."""
    import glob

    for pattern in TCMALLOC_PATTERNS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def with_tcmalloc(env: dict[str, str], device: str, tcmalloc: str | None) -> dict[str, str]:
    """A CPU engine's environment with tcmalloc in ``LD_PRELOAD``, as vLLM's CPU guide asks (SmolLM2 on the CPU
    build: 1.08-1.22 x output tokens/s at 1 and 32 streams, benchmarks/bench_engine_start.py). Left as it is for
    GPU engines, when tcmalloc is not installed, and when the fleet file sets ``engine.env.LD_PRELOAD`` itself."""
    if device != "cpu" or tcmalloc is None or "LD_PRELOAD" in env:
        return env
    return {**env, "LD_PRELOAD": tcmalloc}


def with_compile_cache(env: dict[str, str], device: str) -> dict[str, str]:
    """A CPU engine's environment with ``VLLM_USE_AOT_COMPILE=0``: vLLM 0.32's CPU build fails to load its own AOT
    compile cache ("'function' object has no attribute 'finalize_loading'") and compiles again at every start;
    without AOT, torch's own Inductor cache serves the later starts (benchmarks/bench_engine_start.py ``+noaot``).
    Left as it is for GPU engines and when the fleet file sets ``engine.env.VLLM_USE_AOT_COMPILE`` itself."""
    if device != "cpu" or "VLLM_USE_AOT_COMPILE" in env:
        return env
    return {**env, "VLLM_USE_AOT_COMPILE": "0"}


def engine_env(model: ModelConfig) -> dict[str, str]:
    env: dict[str, str] = dict(model.engine.env)
    if model.engine.cpu_kvcache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(model.engine.cpu_kvcache_space_gib)
    device = engine_device(model)
    return with_compile_cache(with_tcmalloc(env, device, find_tcmalloc()), device)


def engine_device(model: ModelConfig) -> str:
    """``cpu`` or ``gpu``: the configured device, or which vLLM build is installed."""
    if model.engine.device != "auto":
        return model.engine.device
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        return "gpu"


def profiler_trace_dir(model: ModelConfig) -> str | None:
    """Where this model's engines write torch profiler traces: ``engine.profiler_dir/<model slug>`` (None: off)."""
    d = model.engine.profiler_dir
    return f"{d.rstrip('/')}/{_slug(model.name)}" if d else None


def profiler_config(model: ModelConfig) -> dict[str, Any] | None:
    """vLLM's ``profiler_config`` engine argument (0.32 has no VLLM_TORCH_PROFILER_DIR any more). Without Python
    stacks: traces are several times smaller and stopping the profiler is much faster (engine.extra_args
    ``profiler_config`` replaces all of this)."""
    d = profiler_trace_dir(model)
    return {"profiler": "torch", "torch_profiler_dir": d, "torch_profiler_with_stack": False} if d else None


LOCAL_FOLDER_INIT = "lmfleet.engine.node_init.LocalFolderInit"
"""Ray Serve LLM's callback for models that are a local folder (imported by the replica, by name)."""

NO_MEDIA_DOMAINS = ("media-fetching-disabled.invalid",)
"""vLLM's ``allowed_media_domains`` unless engine.extra_args sets it: ``.invalid`` never resolves (RFC 2606)."""


def llm_config_kwargs(model: ModelConfig, model_path: str) -> dict[str, Any]:
    """Keyword arguments for ``ray.serve.llm.LLMConfig`` (kept as plain data for unit tests)."""
    engine_kwargs = model.engine.vllm_kwargs()
    if model.tokenizer:
        engine_kwargs["tokenizer"] = resolve_source(model.tokenizer)
    # vLLM fetches media URLs of any domain when its list is empty or unset; a list that names only a domain
    # that cannot exist makes it fetch none (inline data: URLs still work). engine.extra_args may set it.
    engine_kwargs.setdefault("allowed_media_domains", list(NO_MEDIA_DOMAINS))
    if (prof := profiler_config(model)) is not None:
        engine_kwargs.setdefault("profiler_config", prof)
    if not model.engine.log_metrics:
        engine_kwargs.setdefault("disable_log_stats", True)
    kwargs: dict[str, Any] = {
        "model_loading_config": {"model_id": model.name, "model_source": model_path},
        "engine_kwargs": engine_kwargs,
        "deployment_config": serve_deployment_options(model.deployment),
        "log_engine_metrics": model.engine.log_metrics,
        "accelerator_config": {"kind": engine_device(model)},
    }
    if model.deployment.stream_batching_interval_ms is not None:
        kwargs["experimental_configs"] = {"stream_batching_interval_ms": model.deployment.stream_batching_interval_ms}
    if Path(model_path).is_dir():  # nothing to download: no per-node download task (lmfleet.engine.node_init)
        kwargs["callback_config"] = {"callback_class": LOCAL_FOLDER_INIT}
    env = engine_env(model)
    if env:
        kwargs["runtime_env"] = {"env_vars": env}
    placement = serve_placement(model, gpu=engine_device(model) == "gpu")
    if placement:
        kwargs["placement_group_config"] = placement
    return kwargs


def kv_transfer_config(model: ModelConfig, role: Literal["prefill", "decode"]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for one pool of a prefill/decode split: prefill produces KV, decode consumes it."""
    dis = model.deployment.disaggregation
    if dis is None:
        raise ValueError(f"model {model.name!r} has no deployment.disaggregation")
    out: dict[str, Any] = {"kv_connector": dis.kv_connector,
                           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
    if dis.kv_connector_options:
        out["kv_connector_extra_config"] = dict(dis.kv_connector_options)
    if dis.kv_buffer_device:
        out["kv_buffer_device"] = dis.kv_buffer_device
    return out


def pool_llm_config_kwargs(model: ModelConfig, model_path: str, role: Literal["prefill", "decode"]) -> dict[str, Any]:
    """``LLMConfig`` keyword arguments for one pool of a split model: its engine overrides, replicas, KV connector."""
    kwargs = llm_config_kwargs(model.pool_model(role), model_path)
    kwargs["engine_kwargs"]["kv_transfer_config"] = kv_transfer_config(model, role)
    return kwargs


def serving_pattern(model: ModelConfig) -> Literal["single", "data_parallel", "prefill_decode"]:
    """Which Ray Serve LLM builder deploys the model (:func:`bind_app`)."""
    if model.deployment.disaggregation is not None:
        return "prefill_decode"
    return "data_parallel" if model.engine.data_parallel_size > 1 else "single"


def model_llm_configs(model: ModelConfig, model_path: str) -> tuple[Any, Any]:
    """``(llm_config, prefill_llm_config)``: the model's ``LLMConfig`` (the decode pool's for a split model) and the
    prefill pool's (None unless split)."""
    from ray.serve.llm import LLMConfig

    if serving_pattern(model) != "prefill_decode":
        return LLMConfig(**llm_config_kwargs(model, model_path)), None
    return (LLMConfig(**pool_llm_config_kwargs(model, model_path, "decode")),
            LLMConfig(**pool_llm_config_kwargs(model, model_path, "prefill")))


def build_model_apps(fleet: FleetConfig, progress: Callable[[str], None] = print) -> list[ModelApp]:
    """Resolve weights (building built-in models once) and make one Serve LLM application per model."""
    apps = []
    for model in fleet.models:
        check_router_available(model)  # before building weights: a missing package is a one-line error
        path = resolve_source(model.source, progress=progress)
        tok = resolve_source(model.tokenizer, progress=progress) if model.tokenizer else path
        llm_config, prefill_llm_config = model_llm_configs(model, path)
        apps.append(replace(resolve_model(model, path, tok, llm_config), prefill_llm_config=prefill_llm_config))
    return apps


def gateway_model_apps(fleet: FleetConfig, progress: Callable[[str], None] = print) -> list[ModelApp]:
    """The records a gateway needs (tokenizer, context length, capacity, price) for models that another process
    deployed: no Serve LLM config (``lmfleet gateway``)."""
    apps = []
    for model in fleet.models:
        path = resolve_source(model.source, progress=progress)
        tok = resolve_source(model.tokenizer, progress=progress) if model.tokenizer else path
        apps.append(resolve_model(model, path, tok))
    return apps


ROLLING_UPDATE_FRACTION = 0.001
"""Serve's ``rolling_update_percentage`` for lmfleet's deployments: replicas are replaced max(1, int(fraction x
replicas)) at a time, so one at a time up to 1999 replicas. Serve's surge stays 0: a replacement never needs a
spare accelerator (the old replica stops first)."""


def deployment_version(model: ModelConfig) -> str:
    """The Serve deployment ``version`` of a model's deployments: changes exactly when its engines must be replaced
    (:func:`lmfleet.config.diff.engine_fingerprint`, salted with lmfleet's version)."""
    from lmfleet import __version__

    return engine_fingerprint(model, salt=f"lmfleet {__version__}")


def bind_app(app: ModelApp):
    """The model's Serve application graph, from Ray Serve LLM's builder for its pattern (no deploy), every
    deployment stamped with :func:`deployment_version` (a redeploy of the same engines keeps its replicas)."""
    return ray_private.stamp_versions(_builder_graph(app), deployment_version(app.cfg),
                                      rolling_update_percentage=ROLLING_UPDATE_FRACTION)


def _builder_graph(app: ModelApp):
    from ray.serve.llm import build_dp_openai_app, build_openai_app, build_pd_openai_app

    pattern = serving_pattern(app.cfg)
    if pattern == "prefill_decode":
        return build_pd_openai_app({"prefill_config": app.prefill_llm_config, "decode_config": app.llm_config})
    if pattern == "data_parallel":
        return build_dp_openai_app({"llm_config": app.llm_config})
    if skip_ingress_router(app.cfg):
        # what Ray's direct-streaming builder does (LLMServer as the ingress, its ASGI app built after the engine
        # starts) minus the LLMRouter peer and the RoundRobinRouter it sets: with HAProxy in front, Serve refuses a
        # request router class on the ingress deployment and HAProxy balances itself
        from ray import serve
        from ray.serve.llm import LLMServer, build_llm_deployment

        return build_llm_deployment(app.llm_config, name_prefix="LLMServer:",
                                    deployment_cls=serve.ingress()(app.llm_config.server_cls or LLMServer))
    return build_openai_app({"llm_configs": [app.llm_config]})


def direct_streaming_enabled() -> bool:
    """Whether Ray Serve LLM's builders run in direct-streaming mode in this process (``lmfleet serve`` sets
    ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`` before Ray is imported when ``gateway.serve_proxy`` is haproxy)."""
    return ray_private.llm_direct_streaming_enabled()


def skip_ingress_router(model: ModelConfig, direct_streaming: bool | None = None) -> bool:
    """True when a single-pattern model under direct streaming is deployed without Serve's ingress request router.

    Under direct streaming Ray's builder puts an ``LLMRouter`` deployment in front of the replicas and HAProxy
    calls it (``POST /internal/route``, one HTTP round trip to a Python replica) before every request, only to
    learn which replica to use. For ``request_router: default`` there is nothing for it to know: HAProxy's own
    balancing (``leastconn`` by default, ``RAY_SERVE_HAPROXY_BALANCE_ALGORITHM``) picks the replica with the
    fewest requests in flight from what it already sees. Measured hop by hop: the router call was most of the
    time HAProxy's path added over bare vLLM at one stream (docs/benchmarks.md).
    The routers that need it (prefix_aware, kv_aware, an explicit round_robin) keep it.
    """
    if direct_streaming is None:
        direct_streaming = direct_streaming_enabled()
    return direct_streaming and serving_pattern(model) == "single" and model.deployment.request_router == "default"
