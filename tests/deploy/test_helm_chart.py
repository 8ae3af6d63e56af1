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
    """A RayService always; a Secret only for apiKey.value; an Ingress and a NetworkPolicy
    only when enabled."""
    values = helm.Chart.load(CHART).merge_values(_values(name))
    kinds = sorted(d["kind"] for d in _objects(name))
    expected = ["RayService"]
    expected += ["Secret"] if values["apiKey"]["value"] else []
    expected += ["Ingress"] if values["ingress"]["enabled"] else []
    expected += ["NetworkPolicy"] if values["networkPolicy"]["enabled"] else []
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


# -- closed by default -------------------------------------------------------------------------

SERVE_PORT = 8000
DASHBOARD_PORT = 8265
RAY_CONTROL_PORTS = {6379, 10001, 52365}  # GCS, Ray client, dashboard agent
API_KEY_DIR = "/var/run/secrets/swaserve"
SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CACHE_DIR = "/home/ray/.cache"
# What users need through the Ingress, and what must not be reachable through it by default.
USER_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models"]
CLOSED_PATHS = ["/", "/metrics", "/docs", "/openapi.json", "/tokenize", "/detokenize"]


def _merged(name: str) -> dict[str, Any]:
    return helm.Chart.load(CHART).merge_values(_values(name))


def _pods(name: str) -> dict[str, dict[str, Any]]:
    """The head's and the (one) worker group's pod spec."""
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    return {"head": head, "worker": group["template"]["spec"]}


def _groups(name: str) -> list[dict[str, Any]]:
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _network_policy(name: str) -> dict[str, Any]:
    (policy,) = [d for d in _objects(name) if d["kind"] == "NetworkPolicy"]
    return policy


def _ports(rule: dict[str, Any]) -> set[int] | None:
    """The ports a NetworkPolicy rule admits; None = every port."""
    return {p["port"] for p in rule["ports"]} if rule.get("ports") else None


def _selector() -> dict[str, str]:
    return {"app.kubernetes.io/name": "swaserve", "app.kubernetes.io/instance": "demo"}


def _route_matches(path: dict[str, str], url: str) -> bool:
    """Kubernetes Ingress matching: Exact is equality; Prefix (and, conservatively,
    ImplementationSpecific) matches whole path elements."""
    p = path["path"]
    if path["pathType"] == "Exact":
        return url == p
    return p == "/" or url == p or url.startswith(p.rstrip("/") + "/")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policy_admits_only_serving_from_outside(name: str) -> None:
    """The release's Ray pods admit port 8000 from anywhere, every port from each other, the
    dashboard from the KubeRay operator, and none of Ray's control ports from anyone else."""
    values, spec = _merged(name), _network_policy(name)["spec"]
    assert spec["podSelector"] == {"matchLabels": _selector()}
    for pod_labels in (g["template"]["metadata"]["labels"] for g in _groups(name)):
        assert _selector().items() <= pod_labels.items()
    rules = spec["ingress"]
    open_rules = [r for r in rules if not r.get("from")]
    assert [_ports(r) for r in open_rules] == [{SERVE_PORT}]
    release = [r for r in rules if r.get("from") == [{"podSelector": {"matchLabels": _selector()}}]]
    assert len(release) == 1 and _ports(release[0]) is None
    op = values["networkPolicy"]["operator"]
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": op["namespace"]}},
        "podSelector": {"matchLabels": op["podLabels"]},
    }
    to_dashboard = [r for r in rules if DASHBOARD_PORT in (_ports(r) or set())]
    assert [r["from"] for r in to_dashboard] == [[operator]]
    assert _ports(to_dashboard[0]) == {DASHBOARD_PORT}
    for rule in rules:
        if rule not in release:
            assert _ports(rule) is not None and not _ports(rule) & RAY_CONTROL_PORTS, rule
    assert rules[3:] == values["networkPolicy"]["extraIngress"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_network_policy_egress(name: str) -> None:
    """Egress is open unless restrictEgress; then only to the release's pods, DNS and the
    extra rules (the API server)."""
    values, spec = _merged(name), _network_policy(name)["spec"]
    if not values["networkPolicy"]["restrictEgress"]:
        assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
        return
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    release, dns, *extra = spec["egress"]
    assert release == {"to": [{"podSelector": {"matchLabels": _selector()}}]}
    assert _ports(dns) == {53}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert extra == values["networkPolicy"]["extraEgress"] != []


def test_network_policy_switch() -> None:
    """networkPolicy.enabled=false renders none."""
    docs = _render({"networkPolicy": {"enabled": False}})
    assert not docs["swaserve/templates/networkpolicy.yaml"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_ray_token_auth_is_on(name: str) -> None:
    """KubeRay turns Ray's token authentication on (its Secret: generated or rayAuth.secretName);
    the head exposes no Ray client port."""
    auth = _rayservice(name)["spec"]["rayClusterConfig"]["authOptions"]
    secret = _merged(name)["rayAuth"]["secretName"]
    assert auth == {"mode": "token", **({"secretName": secret} if secret else {})}
    head_ports = {p["containerPort"] for p in _pods(name)["head"]["containers"][0]["ports"]}
    assert head_ports == {6379, DASHBOARD_PORT, SERVE_PORT}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_api_key_is_a_file_on_the_workers_only(name: str) -> None:
    """The key is in no container's environment; with a key, only the worker pods (where Serve
    places the ingress: the head has num-cpus 0) mount its Secret, read-only, 0440, and name the
    file in SWASERVE_API_KEY_FILE."""
    values, pods = _merged(name), _pods(name)
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    autoscaler = cluster["autoscalerOptions"]
    for c in [*pods["head"]["containers"], *pods["worker"]["containers"], autoscaler]:
        assert "SWASERVE_API_KEY" not in {e["name"] for e in c.get("env", [])}
    head = pods["head"]
    assert not [v for v in head["volumes"] if "secret" in v]
    assert "SWASERVE_API_KEY_FILE" not in {e["name"] for e in head["containers"][0]["env"]}
    secrets = [v for v in pods["worker"]["volumes"] if "secret" in v]
    (worker,) = pods["worker"]["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    if not (values["apiKey"]["existingSecret"] or values["apiKey"]["value"]):
        assert not secrets and "SWASERVE_API_KEY_FILE" not in env
        return
    secret_name = values["apiKey"]["existingSecret"] or "demo-swaserve-api-key"
    (volume,) = secrets
    assert volume["secret"] == {
        "secretName": secret_name,
        "items": [{"key": values["apiKey"]["secretKey"], "path": "api-key"}],
        "defaultMode": 0o440,
    }
    mount = {"name": volume["name"], "mountPath": API_KEY_DIR, "readOnly": True}
    assert mount in worker["volumeMounts"]
    assert env["SWASERVE_API_KEY_FILE"] == f"{API_KEY_DIR}/api-key"
    assert pods["worker"]["securityContext"]["fsGroup"] == 100  # the image's group: 0440 readable


@pytest.mark.parametrize("name", VALUE_SETS)
def test_only_the_autoscaler_holds_api_credentials(name: str) -> None:
    """No pod automounts a service account token; the head's autoscaler sidecar (it scales
    through the Kubernetes API) mounts a projected one, and no Ray container does."""
    pods = _pods(name)
    for spec in pods.values():
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert SA_TOKEN_DIR not in {m["mountPath"] for m in c["volumeMounts"]}
    (volume,) = [v for v in pods["head"]["volumes"] if v["name"] == "kube-api-access"]
    token = {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}
    assert token in volume["projected"]["sources"]
    mounts = _rayservice(name)["spec"]["rayClusterConfig"]["autoscalerOptions"]["volumeMounts"]
    assert {"name": "kube-api-access", "mountPath": SA_TOKEN_DIR, "readOnly": True} in mounts
    assert not [v for v in pods["worker"]["volumes"] if "projected" in v]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_containers_run_read_only_unprivileged(name: str) -> None:
    """Every Ray container and the autoscaler: read-only root filesystem, no capabilities, no
    privilege escalation, non-root, RuntimeDefault seccomp; Ray writes to emptyDirs at /tmp
    and ~/.cache (where Triton and the CUDA driver are pointed), the autoscaler to its own /tmp."""
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    locked = {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    autoscaler = cluster["autoscalerOptions"]
    assert autoscaler["securityContext"] == locked
    for spec in _pods(name).values():
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
        empty_dirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"]:
            assert c["securityContext"] == locked
            writable = {m["mountPath"] for m in c["volumeMounts"] if m["name"] in empty_dirs}
            assert writable - {"/dev/shm"} == {"/tmp", CACHE_DIR}
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["TRITON_CACHE_DIR"].startswith(CACHE_DIR + "/")
            assert env["CUDA_CACHE_PATH"].startswith(CACHE_DIR + "/")
    head_empty = {v["name"] for v in _pods(name)["head"]["volumes"] if "emptyDir" in v}
    assert {m["mountPath"] for m in autoscaler["volumeMounts"] if m["name"] in head_empty} == {"/tmp"}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_worker_pods_mount_dev_shm_in_memory(name: str) -> None:
    """NCCL's shared-memory transport between one replica's GPUs (tensor parallelism) needs a
    /dev/shm larger than a container's 64 MB default: every worker container mounts an emptyDir
    of medium Memory there; the head (no GPUs, no replicas) none."""
    pods = _pods(name)
    volumes = {v["name"]: v for v in pods["worker"]["volumes"]}
    for c in pods["worker"]["containers"]:
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
    for c in pods["head"]["containers"]:
        assert all(m["mountPath"] != "/dev/shm" for m in c["volumeMounts"])


@pytest.mark.parametrize("name", [*VALUE_SETS, "ingress-defaults"])
def test_ingress_routes_only_what_users_need(name: str) -> None:
    """Every Ingress path leads to the OpenAI API (or /health): /, /metrics, /docs,
    /openapi.json, /tokenize and /detokenize are not routed."""
    docs = _render({"ingress": {"enabled": True}}) if name == "ingress-defaults" else _rendered(name)
    for ingress in docs["swaserve/templates/ingress.yaml"]:
        paths = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
        for url in USER_PATHS:
            assert any(_route_matches(p, url) for p in paths), url
        for url in CLOSED_PATHS:
            assert not any(_route_matches(p, url) for p in paths), url
        assert all(p["path"].startswith("/v1") or p["path"] == "/health" for p in paths), paths


def test_notes_say_what_is_closed() -> None:
    """NOTES.txt lists what is closed, warns when there is no API key, and tells how to get
    Ray's token for the dashboard."""
    notes = _rendered("default")["NOTES"]
    assert "WARNING: no API key" in notes and "Ray token authentication on" in notes
    assert "jsonpath='{.data.auth_token}'" in notes and "rayClusterName" in notes
    notes = _rendered("pvc-ingress-values")["NOTES"]
    assert "WARNING" not in notes and "get secret swaserve-ray-token" in notes
    assert "The Ingress routes /v1, /health only." in notes


def test_readme_says_what_is_closed_and_how_to_open_it() -> None:
    """The chart README names each closed door and the value that opens it."""
    text = (CHART / "README.md").read_text()
    for needle in [
        "networkPolicy.enabled",
        "networkPolicy.extraIngress",
        "networkPolicy.restrictEgress",
        "rayAuth.mode",
        "SWASERVE_API_KEY_FILE",
        "automountServiceAccountToken",
        "readOnlyRootFilesystem",
        "ingress.hosts",
    ]:
        assert needle in text, needle


# -- the values schema -------------------------------------------------------------------------


def test_values_schema_matches_serve_config() -> None:
    """values.schema.json's serve.config section is generated from ServeConfig (not stale)."""
    spec = importlib.util.spec_from_file_location(
        "gen_values_schema", REPO / "helm" / "gen_values_schema.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, "run: .venv/bin/python helm/gen_values_schema.py"


def test_a_grace_set_in_serve_config_alone_sets_the_pods_grace() -> None:
    """With no workerOptions grace the replicas run the config's (the app's options), and every
    pod's terminationGracePeriodSeconds covers it."""
    values = {"serve": {"config": {"graceful_shutdown_timeout_s": 300},
                        "workerOptions": {"graceful_shutdown_timeout_s": None}}}  # fmt: skip
    rs = next(d for docs in _render(values).values() if isinstance(docs, list) for d in docs
              if d["kind"] == "RayService")  # fmt: skip
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    worker = next(d for d in app["deployments"] if d["name"] == WORKER_DEPLOYMENT)
    assert "graceful_shutdown_timeout_s" not in worker
    assert app["args"]["graceful_shutdown_timeout_s"] == 300
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] == 300 + 2 + 30


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
            {"apiKey": {"value": "v"}, "podSecurityContext": {"fsGroup": None}},
            helm.HelmRenderError,
            "an API key needs podSecurityContext.fsGroup",
        ),
        (
            {"networkPolicy": {"restrictEgress": True}},
            helm.HelmRenderError,
            "restrictEgress needs networkPolicy.extraEgress admitting the Kubernetes API server",
        ),
        ({"rayAuth": {"mode": "off"}}, helm.HelmValuesError, "rayAuth"),
        (
            {"serve": {"config": {"graceful_shutdown_timeout_s": 300}}},
            helm.HelmRenderError,
            "serve.config.graceful_shutdown_timeout_s (300) and serve.workerOptions"
            ".graceful_shutdown_timeout_s (120) differ",
        ),
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
    worker, (app,) = _worker_entry(name), _serve_doc(name)["applications"]
    args = app["args"]
    grace = worker.get("graceful_shutdown_timeout_s", args.get("graceful_shutdown_timeout_s", 60))
    drain = grace + worker.get("graceful_shutdown_wait_loop_s", 2)
    serve = {**yaml.safe_load((CHART / "values.yaml").read_text())["serve"], **_values(name).get("serve", {})}
    margin = serve["shutdownMarginSeconds"]
    cluster = _rayservice(name)["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == math.ceil(drain) + margin and grace > drain, (name, grace, drain)
