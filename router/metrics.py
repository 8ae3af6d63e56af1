r"""Per-policy routing metrics (prometheus_client), labelled `policy`.

| metric | type | recorded by |
|---|---|---|
| `swaserve_router_requests_routed_total` | counter | the router, once per request (first decision) |
| `swaserve_router_decision_seconds` | histogram | the router, time of `RouterCore.decide` |
| `swaserve_router_predicted_cached_tokens` | histogram | the ingress, via `observe_outcome` |
| `swaserve_router_actual_cached_tokens` | histogram | the ingress, via `observe_outcome` |
| `swaserve_router_prediction_error_tokens` | histogram | the ingress: \|predicted − actual\| |
| `swaserve_router_predictions_total{outcome=exact\|over\|under}` | counter | the ingress |

`over` is the dangerous direction: the router credited a prefix the worker could not reuse
(what SWA-unaware routers do on tombstoned tails).

NOTE: the router runs in the ingress process, so both write to the same registry. The router
module is pickled by value by Serve (docs/design.md §14), so it must reach the shared
instance through this module (`router.metrics.default_metrics()`), never a global of its own.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, float("inf"))
_ERROR_BUCKETS = (0, 1, 16, 64, 256, 1024, 4096, 16384, float("inf"))
_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, float("inf"))


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self.routed = Counter(
            "swaserve_router_requests_routed", "Requests routed", ["policy"], registry=reg
        )
        self.decision_seconds = Histogram(
            "swaserve_router_decision_seconds",
            "Time to rank the candidates for one request",
            ["policy"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.predicted = self._tokens("predicted_cached_tokens", "Predicted cached tokens", reg)
        self.actual = self._tokens("actual_cached_tokens", "Cached tokens the worker reported", reg)
        self.error = Histogram(
            "swaserve_router_prediction_error_tokens",
            "|predicted - actual| cached tokens",
            ["policy"],
            buckets=_ERROR_BUCKETS,
            registry=reg,
        )
        self.outcomes = Counter(
            "swaserve_router_predictions",
            "Predictions by outcome (exact, over, under)",
            ["policy", "outcome"],
            registry=reg,
        )

    def observe_decision(self, policy: str, seconds: float) -> None:
        """One request routed (call once per request, not per retry)."""
        self.routed.labels(policy).inc()
        self.decision_seconds.labels(policy).observe(seconds)

    def observe_outcome(self, policy: str, predicted: int, actual: int) -> None:
        """The served replica's prediction against the `cached_tokens` it reported."""
        self.predicted.labels(policy).observe(predicted)
        self.actual.labels(policy).observe(actual)
        self.error.labels(policy).observe(abs(predicted - actual))
        outcome = "exact" if predicted == actual else ("over" if predicted > actual else "under")
        self.outcomes.labels(policy, outcome).inc()

    @staticmethod
    def _tokens(name: str, doc: str, reg: CollectorRegistry) -> Histogram:
        return Histogram(
            f"swaserve_router_{name}", doc, ["policy"], buckets=_TOKEN_BUCKETS, registry=reg
        )


_default: RoutingMetrics | None = None
_default_lock = threading.Lock()


def default_metrics() -> RoutingMetrics:
    """The process-wide instance on prometheus' default registry (what `/metrics` serves).

    NOTE: a module-level singleton because prometheus refuses to register a metric name twice
    on one registry; tests build their own `RoutingMetrics(CollectorRegistry())`.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = RoutingMetrics()
        return _default
