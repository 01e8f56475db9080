"""Every private Ray symbol lmfleet uses, in one place (written for Ray 2.60.0).

lmfleet otherwise uses only Ray's public API (``ray``, ``ray.serve``, ``ray.serve.llm``). Each symbol below has
no public equivalent in Ray 2.60.0; the table says what lmfleet needs it for. ``tests/unit/test_ray_private.py``
imports each one and checks the names, signatures and attributes lmfleet relies on, so that a Ray upgrade that
moves or changes one fails there, naming the symbol and :data:`RAY_VERSION`, rather than at run time.

=====================================================  ====================================================
symbol                                                  why it stays
=====================================================  ====================================================
``ray._private.worker._global_node``                    the connected session's log folder (where the
                                                        engines' logs are), printed when a deploy fails
``ray._private.state.available_resources_per_node``     free CPUs/GPUs per node for ``lmfleet cluster
                                                        status`` (``ray.available_resources`` sums them)
``ray.serve._private.constants.RAY_SERVE_ENABLE_HA_PROXY``  whether Serve read HAProxy mode at its import:
                                                        ``lmfleet serve`` refuses to start when it differs
                                                        from ``gateway.serve_proxy``
``ray.llm._internal.serve.constants.                    whether Ray Serve LLM's builders run in direct-
RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING``                 streaming mode (decides the single-model builder)
``ray.llm._internal.serve.utils.broadcast.broadcast``   calls ``start_profile``/``stop_profile`` on every
                                                        replica of a deployment (``/admin/profile``)
``ray.serve._private.request_router.                    the default router's choice for requests without a
PowerOfTwoChoicesRequestRouter``                        prompt in ``request_router: prefix_aware``
``ray.experimental.internal_kv._internal_kv_get``,      the running fleet's configuration and its version,
``_internal_kv_put``                                    kept in the GCS so that every process of the cluster
                                                        reads the same one (``lmfleet apply``; a detached
                                                        actor would die with its node)
``ray._raylet.GcsClient``,                              ``lmfleet apply`` reads and writes the fleet store
``ray._private.services.canonicalize_bootstrap_         without joining the cluster as a driver (as ``ray
address_or_die``                                        status`` does), which takes seconds
``ray.serve.Application._bound_deployment``,            a deployment ``version`` of lmfleet's own on every
``_ingress_request_router``, ``Deployment.options(       deployment of a model's application (Ray Serve LLM's
version=..., _internal=True)``, ``Deployment.           builders set none: Serve then draws a random one per
_deployment_config``                                    deploy, and every redeploy replaces every replica),
                                                        and the rolling update's batch (no ``options`` key)
=====================================================  ====================================================

``lmfleet.engine.prefix_router`` also subclasses the public ``PrefixCacheAffinityRouter`` and uses its private
members (:data:`PREFIX_ROUTER_MEMBERS`); the same test checks them.

Ray is imported inside each accessor: importing Ray (and Ray Serve LLM, which imports vLLM) takes seconds, and
the CLI's ``--help`` and the gateway's unit tests must not pay for it.
"""

from __future__ import annotations

from typing import Any

RAY_VERSION = "2.60.0"
"""The Ray release these symbols were written and checked against."""

PREFIX_ROUTER_MEMBERS = ("_extract_text_from_request", "_probe_queue_lens", "initialize_state",
                         "choose_replicas", "on_request_routed")
"""Members of Ray's ``PrefixCacheAffinityRouter`` that ``lmfleet.engine.prefix_router`` calls or overrides
(besides the attributes ``initialize_state`` sets: ``_tree_actor``, ``_imbalanced_threshold``,
``_match_rate_threshold``)."""


def ray_logs_dir() -> str | None:
    """This node's Ray log folder for the connected session, or None when not connected."""
    from ray._private import worker

    node = worker._global_node
    return node.get_logs_dir_path() if node is not None else None


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Free resources per live node id (the connected cluster's)."""
    from ray._private import state

    return state.available_resources_per_node()


def serve_haproxy_enabled() -> bool:
    """Whether Ray Serve runs HAProxy as its proxy in this process (read by Serve from the environment at import)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_ENABLE_HA_PROXY)


def llm_direct_streaming_enabled() -> bool:
    """Whether Ray Serve LLM's builders run in direct-streaming mode in this process (read at import)."""
    from ray.llm._internal.serve.constants import RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING

    return bool(RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING)


def broadcast(handle: Any, method_name: str) -> list[Any]:
    """Call ``method_name`` on every replica behind a Serve deployment handle; one result per replica."""
    from ray.llm._internal.serve.utils.broadcast import broadcast as ray_broadcast

    return ray_broadcast(handle, method_name)


def power_of_two_choices_router() -> type:
    """Serve's default request router class (the less loaded of two random replicas)."""
    from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

    return PowerOfTwoChoicesRequestRouter


def kv_get(key: str, namespace: str, client: Any = None) -> bytes | None:
    """The value of ``key`` in the cluster's GCS key-value store (``namespace``), or None: through ``client`` (a
    :func:`gcs_client`) when given, else through the connected driver's (``ray.init``)."""
    if client is not None:
        return client.internal_kv_get(key.encode(), namespace.encode())
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: bytes, *, overwrite: bool, namespace: str, client: Any = None) -> bool:
    """Store ``value`` at ``key`` in the GCS; with ``overwrite`` False an existing value stays. Returns whether
    ``key`` already had a value (Ray's answer: with ``overwrite`` False, True means nothing was written). ``client``:
    as for :func:`kv_get` (Ray's client answers with the keys it added: 0 when ``key`` had a value)."""
    if client is not None:
        return client.internal_kv_put(key.encode(), value, overwrite, namespace.encode()) == 0
    from ray.experimental.internal_kv import _internal_kv_put

    return bool(_internal_kv_put(key, value, overwrite, namespace=namespace))


def gcs_client(address: str | None) -> Any:
    """A client of the GCS of the Ray cluster at ``address`` (``host:port``; None or ``"auto"``: the cluster running
    on this machine) that does not join the cluster as a driver, as ``ray status`` does: no driver to start and
    register, and an address where no cluster answers fails once the client gives up (``ray.exceptions.RpcError`` after about
    40 s) where ``ray.init`` waits on. ConnectionError when no cluster is found on this machine."""
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray._raylet import GcsClient

    return GcsClient(address=canonicalize_bootstrap_address_or_die(address or "auto"))


def stamp_versions(application: Any, version: str, **config: Any) -> Any:
    """Give every deployment of a bound Serve application graph (the ingress, the deployments bound into its
    arguments, its ingress request router) the deployment ``version`` and the ``DeploymentConfig`` values
    ``config`` (e.g. ``rolling_update_percentage``, which ``Deployment.options`` does not take); returns the
    application (changed in place). Serve compares versions on a redeploy: an unchanged one keeps the running
    replicas (replica counts and lightweight options are changed on them), a new one replaces them."""
    from ray.serve.deployment import Application

    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, Application):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            dep = obj._bound_deployment
            walk(dep.init_args)
            walk(dep.init_kwargs)
            stamped = dep.options(version=version, _internal=True)  # a copy: its config is its own
            for key, value in config.items():
                setattr(stamped._deployment_config, key, value)
                stamped._deployment_config.user_configured_option_names.add(key)
            obj._bound_deployment = stamped
            walk(obj._ingress_request_router)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)

    walk(application)
    return application
