"""The real LiteLLM proxy as a benchmark arm: its config (pure), and its process (started, stopped by pid).

LiteLLM is not a dependency of lmfleet: ``make litellm`` installs ``litellm[proxy]`` into its own virtual
environment (``.venv-litellm``), and :func:`litellm_bin` finds it there.

The config (:func:`litellm_config`) gives LiteLLM what lmfleet's gateway has: the model's Serve endpoint (what the
gateway reaches on ``serve_port``: ``/<model>/v1``) and the same provider. One model group per ``stream_timeout``
(:func:`arm_model`), so one proxy serves every timeout arm; each group falls back to its own copy of the provider
(``fallbacks``), with ``num_retries: 0`` (a retry would send the prompt to the engine a second time). LiteLLM's
``stream_timeout`` bounds the wait for the first chunk, which then falls back, and every gap between chunks, which
ends the stream with an error and no fallback. The proxy refuses to start without ``LITELLM_MASTER_KEY``; clients
send it as their Bearer key. Its guard against repeated chunks is off (:data:`REPEAT_LIMIT_OFF`).

Which backend answered is in LiteLLM's response headers (:func:`answered_by_provider`): ``x-litellm-model-api-base``
(the deployment's ``api_base``) and ``x-litellm-attempted-fallbacks``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import yaml

__all__ = ["MASTER_KEY_ENV", "LiteLLMProxy", "answered_by_provider", "arm_model", "litellm_bin", "litellm_config"]

MASTER_KEY_ENV = "LITELLM_MASTER_KEY"
REPEAT_LIMIT_OFF = 10**9
"""LiteLLM ends a stream with a 500 after 100 identical chunks in a row (``REPEATED_STREAMING_CHUNK_LIMIT``): the fake
provider's answers are one word repeated, and a small model made to ignore EOS can loop, so the guard would turn
long answers into errors that have nothing to do with the timeouts under test. The proxy runs with it off."""


def arm_model(model: str, stream_timeout_s: float) -> str:
    """The model name a client sends to reach the arm with this ``stream_timeout``."""
    return f"{model}-litellm-{round(stream_timeout_s * 1000)}ms"


def litellm_config(model: str, serve_base_url: str, provider_base_url: str, provider_model: str,
                   provider_key_env: str, stream_timeouts_s: Sequence[float],
                   request_timeout_s: float = 600.0) -> dict:
    """LiteLLM's proxy config (module docstring). ``serve_base_url``: the model's OpenAI base URL behind Serve
    (``http://127.0.0.1:SERVE_PORT/<model>/v1``); ``provider_key_env``: the environment variable holding the
    provider's key (LiteLLM reads ``os.environ/NAME``)."""
    if not stream_timeouts_s or any(not t > 0 for t in stream_timeouts_s):
        raise ValueError(f"stream_timeouts_s={list(stream_timeouts_s)}: need at least one timeout, each > 0")
    models, fallbacks = [], []
    for t in stream_timeouts_s:
        name = arm_model(model, t)
        models.append({"model_name": name, "litellm_params": {
            "model": f"openai/{model}", "api_base": serve_base_url, "api_key": "none",
            "stream_timeout": t, "timeout": request_timeout_s, "max_retries": 0}})
        models.append({"model_name": f"{name}-provider", "litellm_params": {
            "model": f"openai/{provider_model}", "api_base": provider_base_url,
            "api_key": f"os.environ/{provider_key_env}", "timeout": request_timeout_s, "max_retries": 0}})
        fallbacks.append({name: [f"{name}-provider"]})
    return {
        "model_list": models,
        "router_settings": {"num_retries": 0, "fallbacks": fallbacks},
        "litellm_settings": {"num_retries": 0, "request_timeout": request_timeout_s, "drop_params": True},
        "general_settings": {"master_key": f"os.environ/{MASTER_KEY_ENV}"},
    }


def answered_by_provider(headers: Mapping[str, str], provider_base_url: str) -> bool:
    """Whether LiteLLM's answer came from the provider (its response headers; module docstring)."""
    base = headers.get("x-litellm-model-api-base", "")
    if base:
        return base.rstrip("/") == provider_base_url.rstrip("/")
    with contextlib.suppress(ValueError):
        return int(headers.get("x-litellm-attempted-fallbacks", "0")) > 0
    return False


def litellm_bin(repo: Path) -> Path:
    """The ``litellm`` executable of ``make litellm``'s environment (an error that says how to get it)."""
    path = repo / ".venv-litellm" / "bin" / "litellm"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make litellm` (installs litellm[proxy] into .venv-litellm)")
    return path


class LiteLLMProxy:
    """One LiteLLM proxy process on ``port``, in its own session (so that :func:`autogroup_nice` can rank it),
    stopped by its pid and process group on :meth:`stop` or leaving a ``with`` block, failures included."""

    def __init__(self, exe: Path, config: dict, port: int, master_key: str, workdir: Path,
                 env: Mapping[str, str] | None = None):
        self.exe, self.port, self.master_key, self.workdir = exe, port, master_key, workdir
        self.config_path = workdir / "litellm.yaml"
        self.log_path = workdir / "litellm.log"
        self.config = config
        self.env = {**(env if env is not None else os.environ), MASTER_KEY_ENV: master_key, "LITELLM_LOG": "ERROR",
                    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the remote cost map at start
                    "REPEATED_STREAMING_CHUNK_LIMIT": str(REPEAT_LIMIT_OFF)}
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> float:
        """Start the proxy and wait until it answers; the seconds it took."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.proc = subprocess.Popen([str(self.exe), "--config", str(self.config_path), "--host", "127.0.0.1",
                                      "--port", str(self.port), "--num_workers", "1"], env=self.env,
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        headers = {"authorization": f"Bearer {self.master_key}"}
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the LiteLLM proxy exited with {self.proc.returncode} before it answered:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=5).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the LiteLLM proxy did not answer within {timeout_s:.0f} s (log: {self.log_path})")

    def version(self) -> str:
        """The installed LiteLLM's version (its environment's ``python`` beside ``litellm``)."""
        done = subprocess.run([str(self.exe.parent / "python"), "-c",
                               "import importlib.metadata as m; print(m.version('litellm'))"],
                              capture_output=True, text=True)
        return done.stdout.strip() or "(version unknown)"

    def stop(self, grace_s: float = 15.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)  # its own session: the group is the proxy and its workers
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def __enter__(self) -> "LiteLLMProxy":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
