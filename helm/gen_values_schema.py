"""Keep the chart's `values.schema.json` section for `serve.config` equal to `ServeConfig`.

`serve.config` is passed verbatim as the `args` of `deploy.app:build_app`, so its schema is
generated from the pydantic model (descriptions included; the engine fields' come from
`EngineConfig`'s declarations), with three chart-only rules:

- `api_key` and `metrics_key` are not allowed: the RayService object is readable by anyone who
  can read the namespace, so the API key travels as a Secret (values `apiKey`);
- `worker_num_cpus` and `worker_num_gpus` are required: the pods' resources come from them;
- `workers` or `autoscaling` (when both are set `workers` wins: the chart drops `autoscaling`,
  because `helm lint` cannot unset the default block with null), and `autoscaling` with all its
  keys: the chart renders the worker's `autoscaling_config` from it and Ray replaces it whole.

    .venv/bin/python helm/gen_values_schema.py          # rewrite the section
    .venv/bin/python helm/gen_values_schema.py --check  # exit 1 when it is stale (tests do this)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "swaserve" / "values.schema.json"
_DROP = ("title", "default")


def _clean(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _clean(v) for k, v in node.items() if k not in _DROP}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def serve_config_schema() -> dict[str, Any]:
    """The JSON schema of `serve.config`, derived from `deploy.config.ServeConfig`."""
    from deploy.config import ServeConfig

    raw = ServeConfig.model_json_schema()
    autoscaling = copy.deepcopy(raw["$defs"]["AutoscalingSettings"])
    autoscaling["required"] = sorted(autoscaling["properties"])
    props = {k: v for k, v in raw["properties"].items() if k not in ("api_key", "metrics_key")}
    props["autoscaling"] = {"description": props["autoscaling"]["description"], **autoscaling}
    schema = {
        "type": "object",
        "description": raw["description"] + " Passed as `args` to deploy.app:build_app.",
        "additionalProperties": False,
        "required": ["worker_num_cpus", "worker_num_gpus"],
        "anyOf": [{"required": ["workers"]}, {"required": ["autoscaling"]}],
        "properties": props,
    }
    return _clean(schema)


def render(current: dict[str, Any]) -> dict[str, Any]:
    updated = copy.deepcopy(current)
    updated["properties"]["serve"]["properties"]["config"] = serve_config_schema()
    return updated


def main(argv: list[str]) -> int:
    current = json.loads(SCHEMA_PATH.read_text())
    updated = render(current)
    if "--check" in argv:
        if updated != current:
            print(f"{SCHEMA_PATH} is stale: run .venv/bin/python helm/gen_values_schema.py")
            return 1
        return 0
    SCHEMA_PATH.write_text(json.dumps(updated, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
