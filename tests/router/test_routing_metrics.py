"""RoutingMetrics: per-policy counts, prediction error and outcome direction."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.metrics import RoutingMetrics, default_metrics


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_outcomes_split_by_policy_and_direction() -> None:
    """Exact, over- and under-predictions are counted per policy with the absolute error."""
    reg = CollectorRegistry()
    m = RoutingMetrics(reg)
    m.observe_decision("swa_prefix", 2e-4)
    m.observe_outcome("swa_prefix", 64, 64)
    m.observe_outcome("prefix", 96, 32)
    m.observe_outcome("prefix", 0, 16)
    assert _value(reg, "swaserve_router_requests_routed_total", policy="swa_prefix") == 1
    assert (
        _value(reg, "swaserve_router_predictions_total", policy="swa_prefix", outcome="exact") == 1
    )
    assert _value(reg, "swaserve_router_predictions_total", policy="prefix", outcome="over") == 1
    assert _value(reg, "swaserve_router_predictions_total", policy="prefix", outcome="under") == 1
    assert _value(reg, "swaserve_router_prediction_error_tokens_sum", policy="prefix") == 64 + 16
    assert _value(reg, "swaserve_router_actual_cached_tokens_sum", policy="prefix") == 48


def test_default_metrics_is_shared() -> None:
    """Every caller in a process gets the same instance on the default registry."""
    assert default_metrics() is default_metrics()
