"""The Helm chart, offline: render, lint, validate against KubeRay's CRD and Kubernetes' schemas.

Renders with helm-python-sdk (Helm's Go SDK through ctypes, no binary, no cluster) for the
default values and every `helm/swaserve/ci/*.yaml`. The RayService is checked against the CRD's
openAPIV3Schema made strict (unknown fields are errors, like `kubeconform -strict`); the embedded
Serve config against Ray's `ServeDeploySchema` and our `ServeConfig`; the other objects, the
serve Service and the pod templates against Kubernetes' own schemas (kubernetes-validate).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.config import APP_IMPORT_PATH, WORKER_DEPLOYMENT, ServeConfig
from deploy.serve_file import config_from_document
from worker.config import KNOBS, EngineConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "swaserve"
CRD_PATH = (REPO / ".." / "shared" / "k8s" / "ray.io_rayservices.yaml").resolve()
KUBE_VERSION = "1.30.0"
VALUE_SETS = ["default"] + sorted(p.stem for p in (CHART / "ci").glob("*.yaml"))


def _values(name: str) -> dict[str, Any]:
    if name == "default":
        return {}
    return helm.values_from_yaml((CHART / "ci" / f"{name}.yaml").read_text())


def _render(values: dict[str, Any], release: str = "demo") -> dict[str, list[dict[str, Any]]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=release, namespace="llm", is_install=True)
    docs = {}
    for template, text in out.items():
        if template.endswith(".yaml"):
            docs[template] = [d for d in yaml.safe_load_all(text) if d]
    docs["NOTES"] = out["swaserve/templates/NOTES.txt"]
    return docs


@cache
def _rendered(name: str) -> dict[str, list[dict[str, Any]]]:
    return _render(_values(name))


def _objects(name: str) -> list[dict[str, Any]]:
    return [d for key, docs in _rendered(name).items() if key != "NOTES" for d in docs]


def _rayservice(name: str) -> dict[str, Any]:
    (rs,) = [d for d in _objects(name) if d["kind"] == "RayService"]
    return rs


def _serve_doc(name: str) -> dict[str, Any]:
    return yaml.safe_load(_rayservice(name)["spec"]["serveConfigV2"])


def _serve_config(name: str) -> ServeConfig:
    return config_from_document(_serve_doc(name), f"serveConfigV2[{name}]")


# -- the KubeRay CRD, made strict ------------------------------------------------------------


def _strict(node: Any) -> Any:
    """kubeconform -strict: no unknown fields; int-or-string as JSON schema understands it."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and "additionalProperties" not in out:
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.Draft7Validator:
    if not CRD_PATH.is_file():
        pytest.skip(
            f"KubeRay RayService CRD not found at {CRD_PATH} (the shared/ folder beside the repo)"
        )
    # NOTE: the CRD is ~1 MB; the pure-Python loader takes ~10 s, libyaml's half a second.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD_PATH.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def _crd_errors(validator: jsonschema.Draft7Validator, obj: dict[str, Any]) -> list[str]:
    return sorted(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    )


# -- render and lint -------------------------------------------------------------------------


def test_value_sets_exist() -> None:
    """Besides the defaults, at least two CI value files are rendered."""
    assert len(VALUE_SETS) >= 3, VALUE_SETS


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(name: str) -> None:
    """`helm lint --strict` finds no warning or error."""
    report = helm.lint(CHART, _values(name), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_expected_kinds(name: str) -> None:
    """A RayService always; a Secret only for apiKey.value; an Ingress only when enabled."""
    values = helm.Chart.load(CHART).merge_values(_values(name))
    kinds = sorted(d["kind"] for d in _objects(name))
    expected = ["RayService"]
    expected += ["Secret"] if values["apiKey"]["value"] else []
    expected += ["Ingress"] if values["ingress"]["enabled"] else []
    assert kinds == sorted(expected)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rayservice_matches_crd_strictly(name: str, crd_validator) -> None:
    """Every rendered RayService validates against KubeRay's CRD, unknown fields included."""
    assert _crd_errors(crd_validator, _rayservice(name)) == []


def test_crd_check_catches_mistakes(crd_validator) -> None:
    """The strict CRD check fails on a typo, a missing required field and a bad enum."""
    rs = copy.deepcopy(_rayservice("default"))
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["maxReplica"] = group.pop("minReplicas")
    rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["foo"] = 1
    errors = " | ".join(_crd_errors(crd_validator, rs))
    assert "'minReplicas' is a required property" in errors
    assert "'maxReplica' was unexpected" in errors
    assert "'Fast' is not one of" in errors
    assert "'foo' was unexpected" in errors


# -- the embedded Serve config -----------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_serve_config_validates_with_ray(name: str) -> None:
    """serveConfigV2 passes Ray's ServeDeploySchema, our strict check and ServeConfig."""
    from ray.serve.schema import ServeDeploySchema

    doc = _serve_doc(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ServeDeploySchema.model_validate(doc)
        cfg = _serve_config(name)
    (app,) = doc["applications"]
    assert app["import_path"] == APP_IMPORT_PATH
    assert "api_key" not in app["args"], "the API key must come from a Secret, not the CR"
    assert cfg.engine.page_size == cfg.page_size


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_config_builds_its_engine_config(name: str) -> None:
    """The engine keys of the rendered serve config's flat args build the workers' EngineConfig."""
    (app,) = _serve_doc(name)["applications"]
    engine_keys = {k: v for k, v in app["args"].items() if k in KNOBS}
    assert _serve_config(name).engine == EngineConfig(**engine_keys)


def test_values_reach_the_serve_config() -> None:
    """Model, pool ratio, page size, routing and bounds in values end up in the args."""
    cfg = _serve_config("pvc-ingress-values")
    assert (cfg.model, cfg.page_size, cfg.swa_full_tokens_ratio) == (
        "/models/gemma-3-27b-it",
        32,
        0.5,
    )
    assert (cfg.routing, cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas) == (
        "swa_prefix", 2, 16,
    )  # fmt: skip
    fixed = _serve_config("cpu-tiny-values")
    assert fixed.autoscaling is None and fixed.workers == 2 and fixed.routing == "least_loaded"


def test_fixed_workers_win_over_default_autoscaling() -> None:
    """`--set serve.config.workers=3` gives 3 fixed replicas on 3 pods (autoscaling dropped)."""
    rs = _render({"serve": {"config": {"workers": 3}}})["swaserve/templates/rayservice.yaml"][0]
    cfg = config_from_document(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert cfg.autoscaling is None and cfg.workers == 3
    assert (group["minReplicas"], group["maxReplicas"]) == (3, 3)


# -- Kubernetes schemas for the core objects -------------------------------------------------


def _k8s_validate(obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(
            f"{obj['kind']} {obj.get('metadata', {}).get('name')}: {e.message} at {list(e.path)}"
        )


@pytest.mark.parametrize("name", VALUE_SETS)
def test_core_objects_validate_against_kubernetes(name: str) -> None:
    """Secret/Ingress, the serve Service and both pod templates match Kubernetes' schemas."""
    rs = _rayservice(name)
    for obj in _objects(name):
        if obj["kind"] != "RayService":
            _k8s_validate(obj)
    _k8s_validate({"apiVersion": "v1", "kind": "Service", **rs["spec"]["serveService"]})
    cluster = rs["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    for tmpl in templates:
        _k8s_validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tmpl}
        )


# -- invariants --------------------------------------------------------------------------------


def _worker_entry(name: str) -> dict[str, Any]:
    (app,) = _serve_doc(name)["applications"]
    return next(d for d in app["deployments"] if d["name"] == WORKER_DEPLOYMENT)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_gpu_request_equals_worker_num_gpus(name: str) -> None:
    """Worker pods request and limit exactly the GPUs each worker replica reserves
    (tensor_parallel_size x worker_num_gpus); head none."""
    cfg = _serve_config(name)
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    res = container["resources"]
    gpus = cfg.worker_num_gpus * cfg.tensor_parallel_size
    assert _worker_entry(name)["ray_actor_options"]["num_gpus"] == cfg.worker_num_gpus
    if gpus:
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == gpus
    else:
        assert "nvidia.com/gpu" not in str(res)
    head = cluster["headGroupSpec"]
    assert "nvidia.com/gpu" not in str(head["template"]["spec"]["containers"][0].get("resources"))
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_tensor_parallel_pods_hold_every_rank() -> None:
    """gpu-tp-values: 4 GPUs per worker pod, and the Worker entry reserves the same 4 bundles
    ServeConfig derives (the strict loader compares them)."""
    cfg = _serve_config("gpu-tp-values")
    assert cfg.tensor_parallel_size == 4
    (group,) = _rayservice("gpu-tp-values")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    entry = _worker_entry("gpu-tp-values")
    assert entry["placement_group_bundles"] == cfg.placement_group_bundles()
    assert entry["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in _worker_entry("default")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pod_bounds_follow_replica_bounds(name: str) -> None:
    """minReplicas <= replicas <= maxReplicas, equal to the worker replica bounds; in-tree scaling."""
    cfg = _serve_config(name)
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    lo, hi = (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas) if cfg.autoscaling else (
        cfg.workers, cfg.workers,
    )  # fmt: skip
    assert (group["minReplicas"], group["maxReplicas"]) == (lo, hi)
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert cluster["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pods_run_as_non_root_with_probes(name: str) -> None:
    """Every Ray pod runs as a non-root uid, drops privileges and has both probes."""
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        spec = group["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["livenessProbe"]["httpGet"] and c["readinessProbe"]["httpGet"]
    worker_ready = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "readinessProbe"
    ]
    assert worker_ready["httpGet"] == {"path": "/-/healthz", "port": 8000}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_service_ingress_and_api_key_wiring(name: str) -> None:
    """Ingress targets the serve Service; the API key reaches every pod only from a Secret;
    every pod starts Ray's actors at niceness 0."""
    rs = _rayservice(name)
    svc = rs["spec"]["serveService"]["metadata"]["name"]
    head_ports = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][
        0
    ]["ports"]
    assert {"name": "serve", "containerPort": 8000} in head_ports
    for obj in _objects(name):
        if obj["kind"] == "Ingress":
            backends = [
                p["backend"]["service"] for r in obj["spec"]["rules"] for p in r["http"]["paths"]
            ]
            assert backends and all(b == {"name": svc, "port": {"name": "serve"}} for b in backends)
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0].get("env", [])}
        assert env["RAY_worker_niceness"] == {"name": "RAY_worker_niceness", "value": "0"}
        if "SWASERVE_API_KEY" in env:
            assert set(env["SWASERVE_API_KEY"]) == {"name", "valueFrom"}


def test_long_release_name_fits_kuberay() -> None:
    """KubeRay appends suffixes: the RayService name stays <= 50, the Service name <= 63."""
    rs = [d for d in _render({}, release="r" * 60)["swaserve/templates/rayservice.yaml"]][0]
    assert len(rs["metadata"]["name"]) <= 50
    assert len(rs["spec"]["serveService"]["metadata"]["name"]) <= 63
    helm.validate_release_name("r" * 53)


def test_notes_tell_how_to_reach_the_endpoint() -> None:
    """NOTES.txt: port-forward to the serve Service, or the Ingress host; the auth header."""
    notes = _rendered("default")["NOTES"]
    assert "kubectl -n llm port-forward svc/demo-swaserve-serve-svc 8000:8000" in notes
    assert "/v1/completions" in notes and "Authorization" not in notes
    notes = _rendered("pvc-ingress-values")["NOTES"]
    assert "https://llm.example.com" in notes and "Authorization: Bearer" in notes


# -- the values schema -------------------------------------------------------------------------


def test_values_schema_matches_serve_config() -> None:
    """values.schema.json's serve.config section is generated from ServeConfig (not stale)."""
    spec = importlib.util.spec_from_file_location(
        "gen_values_schema", REPO / "helm" / "gen_values_schema.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, "run: .venv/bin/python helm/gen_values_schema.py"


@pytest.mark.parametrize(
    ("values", "error", "needle"),
    [
        ({"serve": {"config": {"api_key": "x"}}}, helm.HelmValuesError, "'api_key' not allowed"),
        ({"serve": {"config": {"page_size": "16"}}}, helm.HelmValuesError, "page_size"),
        ({"serve": {"config": {"routing": "random"}}}, helm.HelmValuesError, "routing"),
        ({"workerGroup": {"replicas": 3}}, helm.HelmValuesError, "'replicas' not allowed"),
        ({"serve": {"config": {"worker_num_gpus": 0.5}}}, helm.HelmRenderError, "whole number"),
        (
            {"workerGroup": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
            helm.HelmRenderError,
            "comes from serve.config (tensor_parallel_size x worker_num_gpus)",
        ),
        (
            {
                "model": {
                    "volume": {"persistentVolumeClaim": {"claimName": "m"}},
                    "mountPath": "/data",
                }
            },
            helm.HelmRenderError,
            "must be a directory under model.mountPath (/data)",
        ),
        (
            {"workerGroup": {"resources": {"limits": {"cpu": "2000m"}}}},
            helm.HelmRenderError,
            "raise workerGroup.resources cpu",
        ),
        ({"apiKey": {"existingSecret": "s", "value": "v"}}, helm.HelmRenderError, "not both"),
        (
            {
                "serve": {"config": {"tensor_parallel_size": 4, "rank_num_cpus": 2}},
                "workerGroup": {"resources": {"limits": {"cpu": "8"}}},
            },
            helm.HelmRenderError,
            "reserves 10 (worker_num_cpus + (tensor_parallel_size - 1) x rank_num_cpus)",
        ),
    ],
)
def test_bad_values_are_refused(values: dict, error: type, needle: str) -> None:
    """Schema and template checks stop an install with a message naming the value."""
    with pytest.raises(error) as info:
        _render(values)
    assert needle in str(info.value)


# -- the image ---------------------------------------------------------------------------------


def test_image_matches_project_and_chart() -> None:
    """Dockerfile base = pinned Ray version; its user = the chart's uid; tag = appVersion."""
    dockerfile = (REPO / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    ray_pin = re.search(r'"ray\[serve\]==([\d.]+)"', pyproject)[1]
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M)[1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    base = re.search(r"ARG RAY_IMAGE=rayproject/ray:([\d.]+)-py3\d+", dockerfile)
    assert base and base[1] == ray_pin == values["rayVersion"]
    assert f"USER {values['podSecurityContext']['runAsUser']}:" in dockerfile
    assert chart["appVersion"] == version
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored) and "README.md" not in ignored


def test_readme_has_the_commands() -> None:
    """The Deploy-on-Kubernetes text has the operator, build/push, install and access steps."""
    text = (CHART / "README.md").read_text()
    for needle in [
        "helm install kuberay-operator kuberay/kuberay-operator",
        "docker build -t",
        "docker push",
        "helm install swaserve ./helm/swaserve",
        "port-forward svc/swaserve-serve-svc 8000:8000",
        "target_ongoing_requests",
    ]:
        assert needle in text, needle


@pytest.mark.parametrize("name", VALUE_SETS)
def test_termination_grace_covers_the_replica_drain(name: str) -> None:
    """Kubernetes waits after SIGTERM at least as long as Serve drains a worker replica
    (graceful_shutdown_timeout_s, polled every graceful_shutdown_wait_loop_s), plus the margin."""
    worker = _worker_entry(name)
    drain = worker.get("graceful_shutdown_timeout_s", 20) + worker.get(
        "graceful_shutdown_wait_loop_s", 2
    )
    serve = {**yaml.safe_load((CHART / "values.yaml").read_text())["serve"], **_values(name).get("serve", {})}
    margin = serve["shutdownMarginSeconds"]
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == math.ceil(drain) + margin and grace > drain, (name, grace, drain)
