"""Prometheus metrics served by the ingress at `/metrics`.

Two sources end up in one exposition:

- the ingress's own collectors (request latency, time to first token, inter-token latency,
  request/token counters), kept in a private `CollectorRegistry` per ingress replica;
- one gauge per (worker replica, pool, quantity) — the device pools, and the host tier's per kind
  (docs/design.md §9.9) — and the engines' counters, built at scrape time from the stats every worker
  replica reports (`WorkerDeployment.record_routing_stats`, sent to the deployment's index actor
  and read from there by `deploy.replica.client.ServeWorkerClient`). Reading them at scrape time
  instead of pushing through Ray's metrics agent means a scrape shows every running replica,
  about a second old at most, with no dashboard/agent dependency and no stale series for
  replicas that are gone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

POOLS = ("full", "swa")
POOL_FIELDS = ("total", "free", "evictable", "used", "peak_used")
HOST_POOLS = ("host_full", "host_swa")  # EngineStats fields; the label says `full` / `swa`
HOST_FIELDS = ("total", "used")
QUEUE_FIELDS = ("waiting", "running")
COUNTER_FIELDS = (
    "cache_hit_tokens",
    "prompt_tokens",
    "generated_tokens",
    "full_evicted_tokens",
    "swa_evicted_tokens",
    "retractions",
    "aborts",
    "steps",
    "repairs",
    "repaired_tokens",
    "loaded_tokens",
    "loaded_bytes",
    "offloaded_tokens",
)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def flatten_stats(stats: EngineStats) -> dict[str, float]:
    """EngineStats -> flat numbers (`full_free_tokens`, `swa_evictable_tokens`, `waiting`, …).

    The pool keys match `cluster.messages`' routing-stats keys where they overlap."""
    out: dict[str, float] = {}
    for pool in POOLS:
        p = getattr(stats, pool)
        for f in POOL_FIELDS:
            out[f"{pool}_{f}_tokens"] = float(getattr(p, f))
    for pool in HOST_POOLS:
        p = getattr(stats, pool)
        for f in HOST_FIELDS:
            out[f"{pool}_{f}_tokens"] = float(getattr(p, f))
    for f in (*QUEUE_FIELDS, *COUNTER_FIELDS, "tombstone_tokens", "last_step_seconds"):
        out[f] = float(getattr(stats, f))
    out["hybrid"] = 1.0 if stats.hybrid else 0.0
    return out


class ReplicaStatsCollector(Collector):
    """Turns one scrape's `{replica_id: flat stats or None}` into metric families."""

    def __init__(self, snapshot: Mapping[str, Mapping[str, Any] | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("swaserve_replica_up", "1 if the worker replica answered this scrape", labels=["replica"])
        pools = {
            f: GaugeMetricFamily(f"swaserve_kv_{f}_tokens", f"KV pool tokens: {f}", labels=["replica", "pool"])
            for f in POOL_FIELDS
        }
        queues = {
            f: GaugeMetricFamily(f"swaserve_requests_{f}", f"Engine requests {f}", labels=["replica"])
            for f in QUEUE_FIELDS
        }
        host = {
            f: GaugeMetricFamily(f"swaserve_host_kv_{f}_tokens", f"Host KV tier tokens: {f}", labels=["replica", "kind"])
            for f in HOST_FIELDS
        }
        tomb = GaugeMetricFamily("swaserve_tombstone_tokens", "Cached tokens whose SWA KV was freed", labels=["replica"])
        counters = {
            f: CounterMetricFamily(f"swaserve_engine_{f}", f"Engine counter: {f}", labels=["replica"])
            for f in COUNTER_FIELDS
        }
        for replica, stats in sorted(self._snapshot.items()):
            up.add_metric([replica], 0.0 if stats is None else 1.0)
            if stats is None:
                continue
            for pool in POOLS:
                for f in POOL_FIELDS:
                    pools[f].add_metric([replica, pool], float(stats.get(f"{pool}_{f}_tokens", 0.0)))
            for pool in HOST_POOLS:
                for f in HOST_FIELDS:
                    host[f].add_metric([replica, pool.removeprefix("host_")], float(stats.get(f"{pool}_{f}_tokens", 0.0)))
            for f in QUEUE_FIELDS:
                queues[f].add_metric([replica], float(stats.get(f, 0.0)))
            tomb.add_metric([replica], float(stats.get("tombstone_tokens", 0.0)))
            for f in COUNTER_FIELDS:
                counters[f].add_metric([replica], float(stats.get(f, 0.0)))
        yield up
        yield from pools.values()
        yield from host.values()
        yield from queues.values()
        yield tomb
        yield from counters.values()


class IngressMetrics:
    """The ingress replica's own request metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "swaserve_request_latency_seconds", "End-to-end request latency at the ingress",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "swaserve_time_to_first_token_seconds", "Time from request arrival to the first token",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "swaserve_inter_token_latency_seconds", "Time between consecutive generated tokens",
            ["endpoint"], buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "swaserve_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.in_flight = Gauge("swaserve_requests_in_flight", "Generation requests in flight at this ingress", registry=r)
        self.prompt_tokens = Counter("swaserve_prompt_tokens", "Prompt tokens served", registry=r)
        self.cached_tokens = Counter("swaserve_cached_prompt_tokens", "Prompt tokens served from a prefix cache", registry=r)
        self.completion_tokens = Counter("swaserve_completion_tokens", "Generated tokens", registry=r)
        self.repairs = Counter(
            "swaserve_repairs", "Choices whose cached prefix was repaired (its SWA KV rebuilt)", registry=r
        )
        self.repaired_tokens = Counter(
            "swaserve_repaired_prompt_tokens", "Prompt tokens recomputed to repair cached prefixes", registry=r
        )
        self.loads = Counter(
            "swaserve_host_loads", "Choices whose cached prefix was loaded from a worker's host KV tier", registry=r
        )
        self.loaded_tokens = Counter(
            "swaserve_loaded_prompt_tokens",
            "KV tokens of prompts loaded from a worker's host tier (full and SWA counted apart)", registry=r,
        )  # fmt: skip

    def count_repairs(self, repaired_tokens: Sequence[int]) -> None:
        """One finished request's choices: how many were served through a repair, and its rows."""
        self.repairs.inc(sum(1 for n in repaired_tokens if n > 0))
        self.repaired_tokens.inc(sum(repaired_tokens))

    def count_loads(self, loaded_tokens: Sequence[int]) -> None:
        """One finished request's choices: how many loaded KV from the host tier, and how much."""
        self.loads.inc(sum(1 for n in loaded_tokens if n > 0))
        self.loaded_tokens.inc(sum(loaded_tokens))

    def render(self, replica_snapshot: Mapping[str, Mapping[str, Any] | None]) -> bytes:
        """This ingress's metrics, the process default registry (the router's per-policy metrics
        live there, the router runs in this process) and the worker replicas' gauges."""
        replicas = CollectorRegistry()
        replicas.register(ReplicaStatsCollector(replica_snapshot))
        return generate_latest(self.registry) + generate_latest(REGISTRY) + generate_latest(replicas)
