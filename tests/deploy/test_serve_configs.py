"""Every YAML under deploy/configs/ is a valid Ray Serve config that loads into `ServeConfig`.

Also: the strict loader (`deploy.serve_file`) rejects what Ray's lenient schema lets through.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import yaml

from deploy.config import APP_IMPORT_PATH, WORKER_DEPLOYMENT, AutoscalingSettings
from deploy.serve_file import (
    check_serve_document,
    config_from_document,
    load_serve_config,
    load_serve_file,
)
from worker.config import KNOBS, EngineConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "deploy" / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def _doc(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def _worker_entry(doc: dict) -> dict:
    (app,) = [a for a in doc["applications"] if a["import_path"] == APP_IMPORT_PATH]
    return next(d for d in app["deployments"] if d["name"] == WORKER_DEPLOYMENT)


def test_configs_exist() -> None:
    """The local and GPU configs ship."""
    assert {p.name for p in CONFIGS} >= {"local.yaml", "gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_with_ray_strictly(path: Path) -> None:
    """Ray's ServeDeploySchema accepts it, no key is unknown, and Ray emits no warning."""
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(path.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. Ray's look_back_period_s FutureWarning
        schema = ServeDeploySchema.model_validate(doc)
        check_serve_document(doc, str(path))
    assert [a.import_path for a in schema.applications] == [APP_IMPORT_PATH]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_worker_scales(path: Path) -> None:
    """load_serve_config gives the args' ServeConfig; the worker autoscales with every owned key set."""
    cfg = load_serve_config(path)
    entry = _worker_entry(yaml.safe_load(path.read_text()))
    assert cfg.autoscaling is not None
    assert set(AutoscalingSettings.model_fields) <= set(entry["autoscaling_config"])
    assert entry["max_ongoing_requests"] == cfg.max_ongoing_requests
    assert entry["ray_actor_options"]["num_gpus"] == cfg.worker_num_gpus
    assert cfg.autoscaling.max_replicas >= cfg.autoscaling.min_replicas


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_builds_its_engine_config(path: Path) -> None:
    """The engine keys of the file's flat args build the EngineConfig the workers get."""
    (app,) = yaml.safe_load(path.read_text())["applications"]
    engine_keys = {k: v for k, v in app["args"].items() if k in KNOBS}
    assert engine_keys, "a shipped config sets engine knobs"
    assert load_serve_config(path).engine == EngineConfig(**engine_keys)


def test_local_config_fits_this_machine() -> None:
    """local.yaml: CPU only, loopback, and its workers fit in 2 CPUs."""
    served = load_serve_file(CONFIG_DIR / "local.yaml")
    cfg = served.config
    assert (served.host, served.port) == ("127.0.0.1", 8000)
    assert cfg.device == "cpu" and cfg.worker_num_gpus == 0 and cfg.model == "tiny"
    assert cfg.worker_num_cpus * cfg.autoscaling.max_replicas <= 1.0


def test_gpu_config_reserves_gpus() -> None:
    """gpu.yaml: each worker gets a GPU and runs bf16 with FlashInfer."""
    cfg = load_serve_config(CONFIG_DIR / "gpu.yaml")
    assert cfg.device == "cuda" and cfg.worker_num_gpus >= 1
    assert (cfg.dtype, cfg.attention_backend) == ("bfloat16", "flashinfer")
    assert cfg.max_ongoing_requests >= cfg.max_running_requests


def test_ray_file_equals_bare_args(tmp_path: Path) -> None:
    """The args of a Ray file, written as a bare mapping with the Worker entry's grace, load to
    the same config."""
    doc = _doc("gpu.yaml")
    grace = {"graceful_shutdown_timeout_s": _worker_entry(doc)["graceful_shutdown_timeout_s"]}
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({**doc["applications"][0]["args"], **grace}))
    assert load_serve_config(bare) == load_serve_config(CONFIG_DIR / "gpu.yaml")


def test_autoscaling_decision_is_documented() -> None:
    """The README next to the configs states the KV-pressure decision."""
    text = (CONFIG_DIR / "README.md").read_text()
    assert "Decision: workers scale on ongoing requests, not on KV pressure" in text


# -- the strict loader catches what Ray lets through ----------------------------------------


def _mutated(edit) -> dict:
    doc = copy.deepcopy(_doc("local.yaml"))
    edit(doc)
    return doc


def _app(doc: dict) -> dict:
    return doc["applications"][0]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda d: _worker_entry(d)["autoscaling_config"].update(max_replica=3),
            "max_replica: unknown key",
        ),
        (lambda d: _worker_entry(d)["ray_actor_options"].update(num_gpu=1), "num_gpu: unknown key"),
        (
            lambda d: _worker_entry(d).update(max_ongoing_request=3),
            "max_ongoing_request: unknown key",
        ),
        (lambda d: d["http_options"].update(prot=1), "http_options.prot: unknown key"),
        (lambda d: _app(d)["deployments"].append({"name": "Router"}), "'Router' is not a swaserve"),
        (
            lambda d: _worker_entry(d)["autoscaling_config"].update(min_replicas=5),
            "must be greater than or equal to min_replicas",
        ),
    ],
)
def test_strict_check_rejects(edit, needle: str) -> None:
    """Typos and bad values fail with the path of the key (Ray alone accepts all of these)."""
    from ray.serve.schema import ServeDeploySchema

    doc = _mutated(edit)
    ServeDeploySchema.model_validate(doc)  # Ray's lenient schema lets it through...
    with pytest.raises(ValueError, match="applications|http_options") as info:
        check_serve_document(doc, "x.yaml")  # ...ours does not
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda d: _worker_entry(d)["autoscaling_config"].update(max_replicas=2, min_replicas=2),
            "autoscaling_config.min_replicas is 2 but the args imply 1",
        ),
        (lambda d: _worker_entry(d)["ray_actor_options"].pop("num_gpus"), "num_gpus is None"),
        (lambda d: _worker_entry(d).update(max_ongoing_requests=8), "max_ongoing_requests is 8"),
        (
            lambda d: _app(d)["args"].update(graceful_shutdown_timeout_s=45),
            "graceful_shutdown_timeout_s is 30 but the args imply 45.0",
        ),
        (
            lambda d: _worker_entry(d).update(num_replicas=2, autoscaling_config=None),
            "num_replicas is 2 but the args imply None",
        ),
        (lambda d: _app(d)["args"].update(page_size=12), "power of two"),
        (lambda d: _app(d).update(import_path="other.app:build"), "no application has import_path"),
    ],
)
def test_worker_entry_must_agree_with_args(edit, needle: str) -> None:
    """A Worker entry that contradicts args (or bad args) is refused with both values named."""
    with pytest.raises(ValueError) as info:
        config_from_document(_mutated(edit), "x.yaml")
    assert needle in str(info.value)


def test_worker_entry_may_add_ray_only_keys() -> None:
    """Keys ServeConfig does not own (health checks, look-back) are left to Ray."""
    doc = _mutated(lambda d: _worker_entry(d).update(health_check_timeout_s=77))
    _worker_entry(doc)["autoscaling_config"]["look_back_period_s"] = 20
    assert config_from_document(doc).autoscaling.max_replicas == 2


def test_the_worker_entrys_grace_is_the_configs_where_args_leave_it_unset() -> None:
    """A Worker entry's `graceful_shutdown_timeout_s` is what Ray runs the replicas with, so it is
    the config's too (`swaserve serve --config` drains that long); args that set it agreeing are
    fine, and args alone set it where the entry does not."""
    doc = _doc("local.yaml")
    assert _worker_entry(doc)["graceful_shutdown_timeout_s"] == 30
    cfg = config_from_document(doc)
    assert cfg.graceful_shutdown_timeout_s == 30
    assert cfg.worker_deployment_options()["graceful_shutdown_timeout_s"] == 30
    agreeing = _mutated(lambda d: _app(d)["args"].update(graceful_shutdown_timeout_s=30))
    assert config_from_document(agreeing) == cfg
    args_only = _mutated(lambda d: _worker_entry(d).pop("graceful_shutdown_timeout_s"))
    _app(args_only)["args"]["graceful_shutdown_timeout_s"] = 45
    assert config_from_document(args_only).graceful_shutdown_timeout_s == 45
    neither = _mutated(lambda d: _worker_entry(d).pop("graceful_shutdown_timeout_s"))
    assert config_from_document(neither).graceful_shutdown_timeout_s == 60


def test_not_a_mapping(tmp_path: Path) -> None:
    """A YAML list is refused with a message about the expected shape."""
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a YAML mapping"):
        load_serve_config(path)
