"""Model deployments: fleet config -> Ray Serve LLM applications running vLLM."""

from lmfleet.engine.app import ModelApp, build_model_apps, model_app_name, model_route_prefix

__all__ = ["ModelApp", "build_model_apps", "model_app_name", "model_route_prefix"]
