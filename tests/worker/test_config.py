"""`EngineConfig`: each field declared once (default, description, bounds), checked on
construction with messages that name the field and what to change."""

from __future__ import annotations

import dataclasses

import pytest

from worker.config import KNOBS, EngineConfig, Knob
from worker.errors import ConfigError


def test_every_field_declares_a_knob() -> None:
    """Every field has a description (users read it in YAML docs and the Helm schema)."""
    assert list(KNOBS) == [f.name for f in dataclasses.fields(EngineConfig)]
    assert all(knob.description.strip() for _, knob in KNOBS.values())


def test_defaults_are_valid() -> None:
    """The defaults build, and an unset optional knob (None) passes its bounds."""
    assert EngineConfig().max_total_tokens is None
    assert EngineConfig(max_total_tokens=4096, kv_cache_bytes=None).max_total_tokens == 4096


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"cuda_graphs": "always"}, "cuda_graphs 'always' is not one of ['auto', 'off']"),
        ({"device": "gpu"}, "device 'gpu' does not match"),
        ({"model": ""}, "model must have at least 1"),
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"swa_full_tokens_ratio": 1.5}, "swa_full_tokens_ratio must be <= 1, got 1.5"),
        ({"max_total_tokens": 0}, "max_total_tokens must be > 0, got 0"),
        ({"page_size": 12}, "power of two (got 12); try 8"),
        ({"attention_backend": "flashinfer"}, "set device: cuda or attention_backend: torch"),
        ({"tensor_parallel_size": 2, "device": "cuda:1"}, "names one GPU"),
        ({"kv_cache_bytes": 1 << 30, "max_total_tokens": 4096}, "not both"),
        ({"max_total_tokens": 8}, "less than one page (page_size=16)"),
        ({"max_num_batched_tokens": 8, "max_running_requests": 9}, "lower max_running_requests"),
    ],
)
def test_bad_values_say_what_to_change(fields: dict, needle: str) -> None:
    """Each bad value or combination is a ConfigError naming the field."""
    with pytest.raises(ConfigError) as info:
        EngineConfig(**fields)
    assert needle in str(info.value)


def test_every_bad_field_is_named_at_once() -> None:
    """Two bad fields: one error naming both."""
    with pytest.raises(ConfigError, match="seed must be >= 0.*compile 'max'|compile 'max'.*seed"):
        EngineConfig(seed=-1, compile="max")


def test_bounds_are_pydantic_field_names() -> None:
    """`bounds()` hands the set constraints on by the names pydantic's Field takes."""
    knob = Knob("x", choices=("a",), ge=1, le=4, pattern="a")
    assert knob.bounds() == {"ge": 1, "le": 4, "pattern": "a"}
