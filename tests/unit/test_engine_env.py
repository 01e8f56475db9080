"""A CPU engine's environment: tcmalloc in LD_PRELOAD (lmfleet.engine.app.with_tcmalloc) and vLLM's AOT compile
cache off (with_compile_cache)."""

from __future__ import annotations

import pytest

from lmfleet.engine.app import with_compile_cache, with_tcmalloc

TC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("env, device, found, expected", [
    ({}, "cpu", TC, {"LD_PRELOAD": TC}),
    ({"A": "1"}, "cpu", TC, {"A": "1", "LD_PRELOAD": TC}),
    ({}, "gpu", TC, {}),                                             # GPU engines: not asked for
    ({}, "cpu", None, {}),                                           # not installed on this node
    ({"LD_PRELOAD": "/opt/jemalloc.so"}, "cpu", TC, {"LD_PRELOAD": "/opt/jemalloc.so"}),  # the fleet file's own wins
    ({"LD_PRELOAD": ""}, "cpu", TC, {"LD_PRELOAD": ""}),              # set empty: turned off on purpose
])
def test_with_tcmalloc(env, device, found, expected):
    assert with_tcmalloc(env, device, found) == expected
    assert "LD_PRELOAD" not in env or env["LD_PRELOAD"] == expected["LD_PRELOAD"]  # the input is not changed


@pytest.mark.parametrize("env, device, expected", [
    ({}, "cpu", {"VLLM_USE_AOT_COMPILE": "0"}),
    ({"A": "1"}, "cpu", {"A": "1", "VLLM_USE_AOT_COMPILE": "0"}),
    ({}, "gpu", {}),                                                  # GPU engines: as vLLM sets it
    ({"VLLM_USE_AOT_COMPILE": "1"}, "cpu", {"VLLM_USE_AOT_COMPILE": "1"}),  # the fleet file's own wins
])
def test_with_compile_cache(env, device, expected):
    assert with_compile_cache(env, device) == expected
