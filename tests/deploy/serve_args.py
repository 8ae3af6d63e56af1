"""`serve_args`: a `ServeConfig` as the plain, JSON-able `args` of `deploy.app:build_app` (what a
Serve config file or the Helm chart hands Ray)."""

from __future__ import annotations

from typing import Any

from deploy.config import ServeConfig


def serve_args(cfg: ServeConfig) -> dict[str, Any]:
    """Every field, the API key in clear text when set; `workers` left out when autoscaling is
    set (a config names one of the two)."""
    exclude = {"api_key"} | ({"workers"} if cfg.autoscaling is not None else set())
    args = cfg.model_dump(mode="json", exclude=exclude)
    if cfg.api_key is not None:
        args["api_key"] = cfg.api_key.get_secret_value()
    return args
