"""Ray Serve config files that run swaserve: load, check strictly, extract the `ServeConfig`.

The same document shape is used by `serve run FILE`, `serve deploy FILE`, `swaserve serve --config
FILE` and KubeRay's `serveConfigV2`. Ray's own `ServeDeploySchema` ignores unknown keys (it is
forward-compatible on purpose) and keeps every `autoscaling_config` a plain dict until deploy time,
so a typo such as `max_replica:` or `num_gpu:` would pass `serve build`, KubeRay and our own
loading, and silently run with Ray's defaults. This module adds the strictness:

| check                                   | source of truth                                      |
|-----------------------------------------|------------------------------------------------------|
| document shape and values               | `ray.serve.schema.ServeDeploySchema`                 |
| no unknown key at any level             | the fields of Ray's schema models                    |
| each `autoscaling_config`               | `ray.serve.config.AutoscalingConfig` (min <= max, …) |
| `args` of our application               | `ServeConfig` (extra keys forbidden)                 |
| our deployment names                    | `Ingress`, `Worker` (Ray fails late on others)       |
| the `Worker` entry agrees with `args`   | `ServeConfig.worker_deployment_options()`            |
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml

from deploy.config import (
    APP_IMPORT_PATH,
    INGRESS_DEPLOYMENT,
    WORKER_DEPLOYMENT,
    AutoscalingSettings,
    ServeConfig,
)

# Keys of the worker's Serve options that `ServeConfig` owns; sub-keys listed must all be present
# when the parent is, because Ray replaces these two dicts whole.
_OWNED_SUBKEYS = {
    "ray_actor_options": ("num_cpus", "num_gpus"),
    "autoscaling_config": tuple(AutoscalingSettings.model_fields),
}
_OWNED_SCALARS = (
    "num_replicas",
    "max_ongoing_requests",
    "graceful_shutdown_timeout_s",  # where `args` leave it unset the entry's is taken first
    "max_queued_requests",
    "placement_group_bundles",
    "placement_group_strategy",
)
_RAY_UNBOUNDED_QUEUE = -1


@dataclass(frozen=True)
class ServeFile:
    """What a config file says: our config, and Ray's HTTP address when the file is a Serve file."""

    config: ServeConfig
    host: str | None = None
    port: int | None = None


def load_serve_file(path: str | Path) -> ServeFile:
    """Read a bare `ServeConfig` mapping or a Ray Serve config file (see module docstring)."""
    source = str(path)
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, Mapping):
        raise ValueError(
            f"{source}: expected a YAML mapping (ServeConfig fields or a Ray Serve config)"
        )
    if "applications" not in doc:
        return ServeFile(_validate_args(doc, source, where="the file"))
    http = doc.get("http_options") or {}
    return ServeFile(config_from_document(doc, source), http.get("host"), http.get("port"))


def load_serve_config(path: str | Path) -> ServeConfig:
    """The `ServeConfig` of a file of either shape (see `load_serve_file`)."""
    return load_serve_file(path).config


def config_from_document(doc: Mapping[str, Any], source: str = "<serve config>") -> ServeConfig:
    """The `ServeConfig` of the first application importing `deploy.app:build_app`, checked."""
    check_serve_document(doc, source)
    ours = [a for a in doc["applications"] if a.get("import_path") == APP_IMPORT_PATH]
    if not ours:
        found = [a.get("import_path") for a in doc["applications"]]
        raise ValueError(
            f"{source}: no application has import_path {APP_IMPORT_PATH!r} (found {found})"
        )
    app = ours[0]
    cfg = _validate_args(
        app.get("args") or {}, source, where=f"application {app.get('name')!r} args"
    )
    deployments = app.get("deployments") or []
    cfg = _with_entry_lifecycle(cfg, deployments)
    problems = worker_override_problems(cfg, deployments)
    if problems:
        raise ValueError(f"{source}:\n  " + "\n  ".join(problems))
    return cfg


def _with_entry_lifecycle(cfg: ServeConfig, deployments: list[Mapping[str, Any]]) -> ServeConfig:
    """`cfg` with the Worker entry's `graceful_shutdown_timeout_s` where `args` leave it unset:
    Ray runs the replicas with the entry's, and `swaserve serve` drains that long too."""
    entry = next((d for d in deployments if d.get("name") == WORKER_DEPLOYMENT), {})
    key = "graceful_shutdown_timeout_s"
    if key not in entry or key in cfg.model_fields_set:
        return cfg
    return ServeConfig.model_validate({**cfg.model_dump(exclude_unset=True), key: entry[key]})


def check_serve_document(doc: Mapping[str, Any], source: str = "<serve config>") -> None:
    """Raise ValueError listing every problem: Ray's schema, unknown keys, autoscaling, names."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    # NOTE: Ray's validators import policy and router classes named by path, so an ImportError
    # can come out of validation as well as a ValidationError.
    try:
        ServeDeploySchema.model_validate(doc)
    except (pydantic.ValidationError, ImportError, ValueError) as e:
        raise ValueError(f"{source}: not a valid Ray Serve config (ServeDeploySchema):\n{e}") from e
    problems = unknown_keys(doc, ServeDeploySchema)
    for i, app in enumerate(doc["applications"]):
        for j, dep in enumerate(app.get("deployments") or []):
            where = f"applications[{i}].deployments[{j}]"
            if isinstance(dep.get("autoscaling_config"), Mapping):
                try:
                    AutoscalingConfig.model_validate(dep["autoscaling_config"])
                except (pydantic.ValidationError, ImportError, ValueError) as e:
                    problems.append(f"{where}.autoscaling_config: {_first_error(e)}")
            if app.get("import_path") == APP_IMPORT_PATH and dep.get("name") not in (
                INGRESS_DEPLOYMENT,
                WORKER_DEPLOYMENT,
            ):
                problems.append(
                    f"{where}.name: {dep.get('name')!r} is not a swaserve deployment "
                    f"(use {INGRESS_DEPLOYMENT!r} or {WORKER_DEPLOYMENT!r})"
                )
    if problems:
        raise ValueError(f"{source}:\n  " + "\n  ".join(problems))


def unknown_keys(value: Any, model: type[pydantic.BaseModel], where: str = "") -> list[str]:
    """Keys of `value` (recursively) that `model` does not define: Ray's schema, made strict."""
    if not isinstance(value, Mapping):
        return []
    fields = model.model_fields
    by_key = {f.alias: name for name, f in fields.items() if f.alias} | {n: n for n in fields}
    problems = []
    for key, sub in value.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in by_key:
            problems.append(
                f"{path}: unknown key for {model.__name__} (known: {', '.join(sorted(fields))})"
            )
            continue
        for child in _models_in(fields[by_key[key]].annotation)[:1]:
            items = enumerate(sub) if isinstance(sub, list) else [(None, sub)]
            for i, item in items:
                problems += unknown_keys(item, child, path if i is None else f"{path}[{i}]")
    return problems


def worker_override_problems(cfg: ServeConfig, deployments: list[Mapping[str, Any]]) -> list[str]:
    """Where the file's `Worker` entry says something other than `args` (Ray would obey the entry)."""
    entry = next((d for d in deployments if d.get("name") == WORKER_DEPLOYMENT), None)
    if entry is None:
        return []
    expected = cfg.worker_deployment_options()
    expected.setdefault("max_queued_requests", _RAY_UNBOUNDED_QUEUE)
    where = f"deployments[name={WORKER_DEPLOYMENT}]"
    problems = []
    for key in _OWNED_SCALARS:
        if key in entry and entry[key] != expected.get(key):
            problems.append(_disagree(f"{where}.{key}", entry[key], expected.get(key)))
    for key, subkeys in _OWNED_SUBKEYS.items():
        if key not in entry:
            continue
        if expected.get(key) is None:
            problems.append(_disagree(f"{where}.{key}", entry[key], None))
            continue
        given = entry[key] or {}
        for sub in subkeys:
            if given.get(sub) != expected[key][sub]:
                problems.append(
                    _disagree(f"{where}.{key}.{sub}", given.get(sub), expected[key][sub])
                )
    return problems


def _disagree(path: str, given: Any, expected: Any) -> str:
    return (
        f"{path} is {given!r} but the args imply {expected!r}: Ray would run with the file's value "
        "(and replaces ray_actor_options/autoscaling_config whole); make them equal or drop the key"
    )


def _validate_args(args: Any, source: str, where: str) -> ServeConfig:
    try:
        return ServeConfig.model_validate(args)
    except pydantic.ValidationError as e:
        raise ValueError(f"{source}: invalid swaserve config in {where}:\n{e}") from e


def _first_error(e: Exception) -> str:
    if not isinstance(e, pydantic.ValidationError):
        return f"{type(e).__name__}: {e}"
    err = e.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}".lstrip(": ")


def _models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """Pydantic models a field holds (directly, in Optional/Union or in a list), not dict values."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (dict, Mapping):
        return []
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
