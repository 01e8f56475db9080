"""The private Ray symbols behind lmfleet.ray_private still exist and look as lmfleet uses them.

A failure names the symbol and the Ray versions: adapt lmfleet.ray_private (and its callers) to the installed Ray.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import ray

from lmfleet import ray_private


def _fail(symbol: str, what: str) -> None:
    pytest.fail(f"Ray {ray.__version__} changed {symbol} (lmfleet.ray_private was written for Ray "
                f"{ray_private.RAY_VERSION}): {what}", pytrace=False)


def _load(module: str, name: str):
    symbol = f"{module}.{name}"
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        _fail(symbol, f"cannot import it ({type(e).__name__}: {e})")


def _params(symbol: str, fn, expected: list[str]) -> None:
    names = list(inspect.signature(fn).parameters)
    if names[:len(expected)] != expected:
        _fail(symbol, f"parameters are {names}, lmfleet passes {expected}")


def test_global_node_logs_dir():
    from ray._private.node import Node

    worker = importlib.import_module("ray._private.worker")
    if not hasattr(worker, "_global_node"):
        _fail("ray._private.worker._global_node", "no such attribute")
    if not callable(getattr(Node, "get_logs_dir_path", None)):
        _fail("ray._private.node.Node.get_logs_dir_path", "no such method")
    if not ray.is_initialized():
        assert ray_private.ray_logs_dir() is None


def test_available_resources_per_node():
    fn = _load("ray._private.state", "available_resources_per_node")
    _params("ray._private.state.available_resources_per_node", fn, [])


@pytest.mark.parametrize("module, name", [
    ("ray.serve._private.constants", "RAY_SERVE_ENABLE_HA_PROXY"),
    ("ray.llm._internal.serve.constants", "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"),
])
def test_mode_flags_are_booleans(module, name):
    if not isinstance(_load(module, name), bool):
        _fail(f"{module}.{name}", "no longer a bool read from the environment")


def test_mode_flag_accessors():
    assert isinstance(ray_private.serve_haproxy_enabled(), bool)
    assert isinstance(ray_private.llm_direct_streaming_enabled(), bool)


def test_broadcast():
    fn = _load("ray.llm._internal.serve.utils.broadcast", "broadcast")
    _params("ray.llm._internal.serve.utils.broadcast.broadcast", fn, ["handle", "method_name"])


def test_power_of_two_choices_router():
    symbol = "ray.serve._private.request_router.PowerOfTwoChoicesRequestRouter"
    cls = ray_private.power_of_two_choices_router()
    from ray.serve.request_router import RequestRouter

    if not (isinstance(cls, type) and issubclass(cls, RequestRouter)):
        _fail(symbol, "not a RequestRouter subclass any more")
    if not inspect.iscoroutinefunction(cls.choose_replicas):
        _fail(symbol, "choose_replicas is not a coroutine function")
    _params(symbol, cls.choose_replicas, ["self", "candidate_replicas", "pending_request"])


def test_prefix_cache_affinity_router_members():
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    for member in ray_private.PREFIX_ROUTER_MEMBERS:
        if not callable(getattr(PrefixCacheAffinityRouter, member, None)):
            _fail(f"PrefixCacheAffinityRouter.{member}", "no such method")
    source = inspect.getsource(PrefixCacheAffinityRouter.initialize_state)
    for attr in ("_tree_actor", "_imbalanced_threshold", "_match_rate_threshold"):
        if f"self.{attr}" not in source:
            _fail(f"PrefixCacheAffinityRouter.{attr}", "initialize_state no longer sets it")


@pytest.mark.parametrize("name, params", [
    ("_internal_kv_get", ["key", "namespace"]),
    ("_internal_kv_put", ["key", "value", "overwrite", "namespace"]),
])
def test_internal_kv(name, params):
    module = "ray.experimental.internal_kv"
    _params(f"{module}.{name}", _load(module, name), params)


def test_gcs_client_without_a_driver():
    """gcs_client: Ray's GCS client class takes an address and has the key-value calls lmfleet makes; the address
    lookup takes the user's address."""
    _load("ray._raylet", "GcsClient")
    inner = _load("ray._raylet", "InnerGcsClient")  # GcsClient hands its calls to it
    for member in ("internal_kv_get", "internal_kv_put"):
        if not callable(getattr(inner, member, None)):
            _fail(f"ray._raylet.InnerGcsClient.{member}", "no such method")
    module = "ray._private.services"
    _params(f"{module}.canonicalize_bootstrap_address_or_die",
            _load(module, "canonicalize_bootstrap_address_or_die"), ["addr"])


def test_client_kv_speaks_bytes_and_reads_puts_answer():
    """Ray's client takes bytes and answers a put with the number of keys it added (0: the key had a value)."""
    class Client:
        def __init__(self):
            self.data = {}

        def internal_kv_get(self, key, namespace):
            assert isinstance(key, bytes) and isinstance(namespace, bytes)
            return self.data.get((namespace, key))

        def internal_kv_put(self, key, value, overwrite, namespace):
            existed = (namespace, key) in self.data
            if overwrite or not existed:
                self.data[(namespace, key)] = value
            return 0 if existed else 1

    c = Client()
    assert ray_private.kv_get("k", "ns", c) is None
    assert ray_private.kv_put("k", b"1", overwrite=False, namespace="ns", client=c) is False
    assert ray_private.kv_put("k", b"2", overwrite=False, namespace="ns", client=c) is True
    assert ray_private.kv_get("k", "ns", c) == b"1"
    assert ray_private.kv_put("k", b"3", overwrite=True, namespace="ns", client=c) is True
    assert ray_private.kv_get("k", "ns", c) == b"3"


def test_deployment_version_members():
    """stamp_versions: an application holds its deployment and ingress router where lmfleet reads them, and
    Deployment.options takes a version (internally) and the rolling update's batch size."""
    from ray import serve

    @serve.deployment
    class Child:
        pass

    @serve.deployment
    class Parent:
        def __init__(self, children):
            self.children = children

    app = Parent.bind([Child.bind()])
    for attr in ("_bound_deployment", "_ingress_request_router"):
        if not hasattr(app, attr):
            _fail(f"ray.serve.Application.{attr}", "no such attribute")
    ray_private.stamp_versions(app, "v1", rolling_update_percentage=0.001)
    child = app._bound_deployment.init_args[0][0]
    for d in (app._bound_deployment, child._bound_deployment):
        if d.version != "v1" or d._deployment_config.rolling_update_percentage != 0.001:
            _fail("ray.serve.Deployment.options", f"version={d.version!r}, rolling_update_percentage="
                  f"{d._deployment_config.rolling_update_percentage} after options(version=..., _internal=True)")
