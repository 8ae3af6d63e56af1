"""`ServeConfig`: validation messages, the one conversion to `EngineConfig`, Serve options, env."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.config import (
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    AutoscalingSettings,
    ServeConfig,
    api_key_from_file,
)
from deploy.serve_file import load_serve_config
from tests.deploy.serve_args import serve_args
from worker.config import KNOBS, EngineConfig
from worker.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def _error(**fields: object) -> str:
    with pytest.raises(pydantic.ValidationError) as info:
        ServeConfig(**fields)
    return str(info.value)


# -- the conversion to EngineConfig ---------------------------------------------------------


def test_every_engine_field_has_a_serve_field() -> None:
    """Every EngineConfig field is settable in a config, under its own name."""
    missing = {f.name for f in dataclasses.fields(EngineConfig)} - set(ServeConfig.model_fields)
    assert not missing, f"ServeConfig lacks EngineConfig fields {sorted(missing)}"


def test_defaults_equal_engine_defaults() -> None:
    """ServeConfig's defaults are EngineConfig's: one place decides them."""
    assert ServeConfig().engine == EngineConfig()


def test_engine_fields_are_declared_by_engine_config() -> None:
    """Each engine field's default, description and choices are EngineConfig's declaration."""
    defaults = EngineConfig()
    for name, (_, knob) in KNOBS.items():
        field = ServeConfig.model_fields[name]
        assert (field.default, field.description) == (getattr(defaults, name), knob.description)
    schema = ServeConfig.model_json_schema()["properties"]
    assert schema["compile"]["enum"] == ["auto", "off"] and schema["page_size"]["minimum"] == 1


def test_engine_errors_are_engine_config_errors() -> None:
    """A bad engine value in a config fails with the message EngineConfig itself gives."""
    with pytest.raises(ConfigError) as info:
        EngineConfig(attention_backend="flashinfer")
    assert str(info.value) in _error(attention_backend="flashinfer")


def test_engine_carries_every_value() -> None:
    """Each non-default value reaches the engine config unchanged."""
    cfg = ServeConfig(
        model="/models/m", device="cuda:1", dtype="bfloat16", attention_backend="flashinfer",
        page_size=4, max_total_tokens=4096, swa_full_tokens_ratio=0.25,
        disable_hybrid_swa_memory=True, enable_radix_cache=False, chunked_prefill_size=64,
        max_running_requests=7, swa_eviction_interval=8, eager_swa_free=True, max_model_len=2048,
        seed=3, worker_num_gpus=1,
    )  # fmt: skip
    engine = cfg.engine
    for f in dataclasses.fields(EngineConfig):
        assert getattr(engine, f.name) == getattr(cfg, f.name), f.name
    assert engine.page_size == 4 and engine.device == "cuda:1" and engine.eager_swa_free


def test_every_field_has_a_description() -> None:
    """The YAML surface documents itself (also feeds the Helm values schema)."""
    for model in (ServeConfig, AutoscalingSettings):
        bare = [n for n, f in model.model_fields.items() if not (f.description or "").strip()]
        assert not bare, f"{model.__name__} fields without description: {bare}"


def test_frozen() -> None:
    """Nothing mutates a config after construction."""
    cfg = ServeConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.page_size = 32  # type: ignore[misc]


# -- validation messages --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"page_size": 12}, "power of two (got 12); try 8"),
        ({"device": "cuda"}, "set worker_num_gpus: 1"),
        ({"worker_num_gpus": 1}, "set device: cuda or worker_num_gpus: 0"),
        ({"attention_backend": "flashinfer"}, "flashinfer' runs on GPUs only"),
        ({"kv_cache_bytes": 1 << 30, "max_total_tokens": 4096}, "not both"),
        ({"max_total_tokens": 8}, "less than one page"),
        ({"workers": 2, "autoscaling": {}}, "either workers"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "max_replicas (2) must be >="),
        (
            {"max_ongoing_requests": 4, "autoscaling": {"target_ongoing_requests": 8}},
            "exceeds max_ongoing_requests",
        ),
        ({"autoscale": {"max_replicas": 2}}, "Extra inputs are not permitted"),
        ({"autoscaling": {"max_replica": 2}}, "max_replica"),
        ({"routing": "random"}, "swa_prefix"),
        ({"swa_full_tokens_ratio": 0}, "greater than 0"),
        ({"swa_full_tokens_ratio": 1.5}, "less than or equal to 1"),
        ({"device": "gpu"}, "pattern"),
        ({"max_queued_requests": 0}, "greater than or equal to 1"),
        ({"tensor_parallel_size": 0}, "greater than or equal to 1"),
        (
            {"tensor_parallel_size": 2, "device": "cuda", "worker_num_gpus": 2},
            "one rank per GPU: set worker_num_gpus: 1",
        ),
        ({"tensor_parallel_size": 2, "device": "cuda:1", "worker_num_gpus": 1}, "set device: cuda"),
        ({"tensor_parallel_size": 2, "worker_num_cpus": 0}, "set worker_num_cpus > 0"),
        ({"placement_group_strategy": "TIGHT"}, "STRICT_PACK"),
    ],
)
def test_invalid_configs_say_what_to_change(fields: dict, needle: str) -> None:
    """Each bad value is rejected with a message naming the fix."""
    assert needle in _error(**fields)


def test_valid_gpu_config() -> None:
    """A consistent GPU config passes and keeps its values."""
    cfg = ServeConfig(device="cuda", worker_num_gpus=1, attention_backend="flashinfer")
    assert cfg.engine.attention_backend == "flashinfer"


# -- Serve options ---------------------------------------------------------------------------


def test_fixed_workers_give_num_replicas() -> None:
    """Without autoscaling the worker deployment has exactly `workers` replicas."""
    opts = ServeConfig(workers=3, worker_num_cpus=2).worker_deployment_options()
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    assert "max_queued_requests" not in opts


def test_autoscaling_gives_autoscaling_config() -> None:
    """With autoscaling every owned key is present (Ray replaces the dict whole)."""
    cfg = ServeConfig(autoscaling={"min_replicas": 2, "max_replicas": 5}, max_queued_requests=9)
    opts = cfg.worker_deployment_options()
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {
        "min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 16.0,
        "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
    }  # fmt: skip
    assert opts["max_queued_requests"] == 9


def test_options_validate_with_ray() -> None:
    """The options are valid Ray Serve deployment options (Ray's own models)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema

    cfg = ServeConfig(autoscaling={"min_replicas": 0, "max_replicas": 3}, max_queued_requests=4)
    opts = cfg.worker_deployment_options()
    DeploymentSchema(name="Worker", **opts)
    assert AutoscalingConfig(**opts["autoscaling_config"]).max_replicas == 3


# -- the API key ------------------------------------------------------------------------------


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset in the config, the key comes from SWASERVE_API_KEY; an explicit one wins."""
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServeConfig().api_key.get_secret_value() == "from-env"
    assert ServeConfig(api_key="explicit").api_key.get_secret_value() == "explicit"


def test_empty_env_means_no_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty or blank variable does not turn auth on with an empty token."""
    monkeypatch.setenv(API_KEY_ENV, "  ")
    assert ServeConfig().api_key is None


def test_api_key_file(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """SWASERVE_API_KEY_FILE: unset gives None; the file's key, stripped; an empty or missing
    file raises (a key was meant: never serve without it)."""
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    assert api_key_from_file() is None
    (tmp_path / "key").write_text("s3cret\n")
    monkeypatch.setenv(API_KEY_FILE_ENV, str(tmp_path / "key"))
    assert api_key_from_file() == "s3cret"
    (tmp_path / "key").write_text(" \n")
    with pytest.raises(ValueError, match="empty"):
        api_key_from_file()
    monkeypatch.setenv(API_KEY_FILE_ENV, str(tmp_path / "absent"))
    with pytest.raises(OSError):
        api_key_from_file()


def test_api_key_is_not_printed_but_reaches_args() -> None:
    """repr hides the key; `serve_args` (what build_app receives) carries it in clear text."""
    cfg = ServeConfig(api_key="s3cret")
    assert "s3cret" not in repr(cfg) and "s3cret" not in str(cfg.model_dump())
    args = serve_args(cfg)
    assert args["api_key"] == "s3cret"
    assert ServeConfig.model_validate(args) == cfg


# -- a bare mapping file ------------------------------------------------------------------------


def test_bare_mapping_file(tmp_path) -> None:
    """A plain mapping of ServeConfig fields loads as is."""
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\npage_size: 32\nautoscaling: {min_replicas: 1, max_replicas: 2}\n")
    cfg = load_serve_config(path)
    assert cfg.page_size == 32 and cfg.autoscaling.max_replicas == 2


def test_bad_bare_file_names_the_file(tmp_path) -> None:
    """A bad bare file fails with its path and the field in the message."""
    path = tmp_path / "bad.yaml"
    path.write_text("page_size: 12\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*\n(.|\n)*page_size"):
        load_serve_config(path)


# -- properties --------------------------------------------------------------------------------

_autoscaling = st.builds(
    lambda lo, extra, target: {"min_replicas": lo, "max_replicas": max(1, lo + extra),
                               "target_ongoing_requests": target},
    st.integers(0, 8), st.integers(0, 8), st.integers(1, 64),
)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    page_shift=st.integers(0, 7),
    ratio=st.floats(0.01, 1.0),
    autoscaling=st.none() | _autoscaling,
    max_ongoing=st.integers(64, 256),
)
def test_valid_configs_round_trip(
    page_shift: int, ratio: float, autoscaling, max_ongoing: int
) -> None:
    """Any valid config survives serve_args -> validate, and its options satisfy Ray's autoscaler."""
    from ray.serve.config import AutoscalingConfig

    cfg = ServeConfig(page_size=1 << page_shift, swa_full_tokens_ratio=ratio,
                      autoscaling=autoscaling, max_ongoing_requests=max_ongoing)  # fmt: skip
    assert ServeConfig.model_validate(serve_args(cfg)) == cfg
    assert cfg.engine.page_size == 1 << page_shift
    opts = cfg.worker_deployment_options()
    if autoscaling is not None:
        ray_cfg = AutoscalingConfig(**opts["autoscaling_config"])
        assert ray_cfg.min_replicas <= ray_cfg.max_replicas


def test_served_model_name_is_the_model_id_clients_use() -> None:
    from deploy.app import IngressSettings, ingress_options

    cfg = ServeConfig(model="tiny", served_model_name="my-model")
    opts = ingress_options(cfg, IngressSettings())
    assert opts.service.model_name == "my-model" and opts.model == "tiny"
    assert ingress_options(ServeConfig(model="tiny"), IngressSettings()).service.model_name == "tiny"


def test_the_ingress_fields_reach_the_ingress() -> None:
    """Admission bounds, deadline, write timeout, metrics key and switch, ingress replicas:
    from ServeConfig to the ingress options and the Ingress deployment."""
    from deploy.app import IngressSettings, build_app_from_config, ingress_options
    from deploy.openai.admission import AdmissionLimits
    from tests import serve_internals

    cfg = ServeConfig(model="tiny", max_inflight_sequences=8, max_inflight_tokens=4096, request_timeout_s=5,
                      write_timeout_s=2, metrics_key="scrape", metrics_auth=False, ingress_replicas=2)  # fmt: skip
    opts = ingress_options(cfg, IngressSettings())
    assert opts.service.admission == AdmissionLimits(8, 4096) and opts.service.request_timeout_s == 5
    assert (opts.write_timeout_s, opts.metrics_key, opts.metrics_auth) == (2, "scrape", False)
    app = serve_internals.build_app(build_app_from_config(cfg), name="swaserve")
    (ingress,) = [d for d in app.deployments if d.name == "Ingress"]
    assert ingress.num_replicas == 2 and ingress.max_ongoing_requests == 8 + 32
    assert ServeConfig(model="tiny").request_timeout_s == 1800 and ServeConfig(request_timeout_s=None).request_timeout_s is None


def test_both_deployments_run_with_the_replica_environment() -> None:
    """Our code on Serve's own loop and Serve's metrics exported once a second, in the ingress
    and the worker replicas alike (docs/design.md §4.2)."""
    from deploy.app import REPLICA_ENV, build_app_from_config
    from tests import serve_internals

    assert REPLICA_ENV["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
    app = serve_internals.build_app(build_app_from_config(ServeConfig(model="tiny")), name="swaserve")
    envs = {d.name: d.ray_actor_options["runtime_env"]["env_vars"] for d in app.deployments}
    assert envs == {"Ingress": REPLICA_ENV, "Worker": REPLICA_ENV}


def test_tensor_parallel_reserves_one_bundle_per_rank() -> None:
    """TP = N: N bundles (replica first, rank actors after), STRICT_PACK, a GPU each on CUDA."""
    gpu = ServeConfig(device="cuda", worker_num_gpus=1, worker_num_cpus=4, rank_num_cpus=2,
                      tensor_parallel_size=4).worker_deployment_options()  # fmt: skip
    assert gpu["placement_group_bundles"] == [{"CPU": 4, "GPU": 1}] + [{"CPU": 2, "GPU": 1}] * 3
    assert gpu["placement_group_strategy"] == "STRICT_PACK"
    assert gpu["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}  # fits bundle 0
    cpu = ServeConfig(tensor_parallel_size=2, worker_num_cpus=0.25, rank_num_cpus=0.25)
    assert cpu.worker_deployment_options()["placement_group_bundles"] == [{"CPU": 0.25}] * 2
    assert "placement_group_bundles" not in ServeConfig().worker_deployment_options()
    assert cpu.engine.tensor_parallel_size == 2
