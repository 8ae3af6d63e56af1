"""`swaserve bench routing --real`: the policies on the real stack (Ray Serve, tiny workers).

One local Ray cluster on loopback; per policy the swaserve application is deployed with that
`routing` (2 tiny workers with small KV pools so the SWA pool is under pressure), the traffic of
`real_traffic.py` is sent over HTTP, and the application and its cache-index actor are
deleted, so each policy starts from cold caches. Timings are wall clock on this machine.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.harness import markdown_table
from bench.local_serve import deployed, local_serve
from bench.routing.figures import quantile
from bench.routing.real_traffic import MODEL, Sample, Traffic, run_traffic

if TYPE_CHECKING:
    from deploy.config import ServeConfig


@dataclass(frozen=True)
class RealSettings:
    policies: tuple[str, ...]
    workers: int = 2
    num_cpus: int = 2
    max_total_tokens: int = 4096  # full pool per worker
    swa_ratio: float = 0.25  # SWA pool 1024 tokens: three 320-token tenants do not fit
    # NOTE: prompts shorter than one chunk are request-owned until they finish, and their SWA
    # out of the window is freed during decode; 64-token chunks put the tenants' system prompts
    # into the tree (SWA kept) while they prefill, as 512-token chunks do for 2k-token prompts.
    chunked_prefill_size: int = 64
    seed: int = 0
    startup_timeout_s: float = 300.0
    traffic: Traffic = field(default_factory=Traffic)


@dataclass(frozen=True)
class RealPolicyResult:
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens: int  # Σ (prompt − cached): what the workers computed
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_tok_s: float  # completion tokens / wall seconds of the whole traffic
    predictions: int  # responses carrying the router's prediction header
    predictions_exact: int
    predictions_over: int
    per_replica: dict[str, int]
    deploy_s: float
    traffic_s: float
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class RealResult:
    settings: RealSettings
    policies: tuple[RealPolicyResult, ...]
    wall_s: float


def run_real(s: RealSettings) -> RealResult:
    """Start Ray, run every policy in turn, stop Ray (also on errors)."""
    t0 = time.perf_counter()
    with local_serve(s.num_cpus, MODEL) as url:
        out = [_one_policy(s, policy, url) for policy in s.policies]
    return RealResult(s, tuple(out), time.perf_counter() - t0)


def _one_policy(s: RealSettings, policy: str, url: str) -> RealPolicyResult:
    with deployed(_config(s, policy), url, s.startup_timeout_s) as (deploy_s, headers):
        t1 = time.perf_counter()
        samples = asyncio.run(run_traffic(url, s.traffic, headers))
        traffic_s = time.perf_counter() - t1
    return _figures(policy, samples, deploy_s, traffic_s)


def _config(s: RealSettings, policy: str) -> ServeConfig:
    from deploy.config import ServeConfig

    share = round((s.num_cpus - 0.25) / s.workers - 0.005, 2)  # the ingress takes 0.25 CPU
    return ServeConfig.model_validate({
        "model": MODEL, "workers": s.workers, "routing": policy, "worker_num_cpus": share,
        "max_total_tokens": s.max_total_tokens, "swa_full_tokens_ratio": s.swa_ratio,
        "chunked_prefill_size": s.chunked_prefill_size, "seed": s.seed,
    })  # fmt: skip


def _figures(
    policy: str, samples: list[Sample], deploy_s: float, traffic_s: float
) -> RealPolicyResult:
    prompt = sum(x.prompt_tokens for x in samples)
    cached = sum(x.cached_tokens for x in samples)
    ttft = [x.ttft_s for x in samples]
    predicted = [x for x in samples if x.predicted is not None]
    return RealPolicyResult(
        policy=policy, requests=len(samples), prompt_tokens=prompt, cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0, prefill_tokens=prompt - cached,
        ttft_p50_s=quantile(ttft, 0.5), ttft_p99_s=quantile(ttft, 0.99),
        throughput_tok_s=sum(x.completion_tokens for x in samples) / traffic_s,
        predictions=len(predicted),
        predictions_exact=sum(x.predicted == x.cached_tokens for x in predicted),
        predictions_over=sum(x.predicted > x.cached_tokens for x in predicted),  # type: ignore[operator]
        per_replica=dict(Counter(x.replica for x in samples)), deploy_s=deploy_s,
        traffic_s=traffic_s, samples=tuple(samples),
    )  # fmt: skip


# ---------------------------------------------------------------- report


def real_table(r: RealResult) -> str:
    headers = ["policy", "requests", "hit rate", "prefill tokens", "TTFT p50 ms", "TTFT p99 ms",
               "tok/s", "predictions exact", "over", "per replica", "deploy s"]  # fmt: skip
    rows = [[p.policy, str(p.requests), f"{p.hit_rate:.3f}", f"{p.prefill_tokens:,}",
             f"{p.ttft_p50_s * 1e3:.0f}", f"{p.ttft_p99_s * 1e3:.0f}", f"{p.throughput_tok_s:.1f}",
             f"{p.predictions_exact}/{p.predictions}", str(p.predictions_over),
             " ".join(f"{n}" for n in sorted(p.per_replica.values(), reverse=True)),
             f"{p.deploy_s:.0f}"] for p in r.policies]  # fmt: skip
    return markdown_table(headers, rows)


def real_summary(r: RealResult) -> str:
    s, t = r.settings, r.settings.traffic
    return "\n\n".join([
        f"{s.workers} tiny workers (window 32, page 16) on a local Ray cluster with {s.num_cpus} "
        f"CPUs; full pool {s.max_total_tokens} tokens, SWA pool {s.swa_ratio:g} x that, chunked "
        f"prefill {s.chunked_prefill_size}. Per policy a fresh deployment; traffic: "
        f"{t.tenant_requests} completions over {t.tenants} tenants ({t.system_tokens}-token "
        f"system prompts + {t.user_tokens[0]}-{t.user_tokens[1]} token user turns) and {t.chats} "
        f"chats of {t.turns} turns, {t.max_tokens} new tokens each, {t.concurrency} request(s) at a time. "
        f"Wall clock on this machine; the whole real part took {r.wall_s:.0f} s.",
        real_table(r),
        "*hit rate* and *prefill tokens* from `usage.prompt_tokens_details.cached_tokens`; "
        "*predictions* compare `x-swaserve-predicted-cached-tokens` with it; *TTFT* = time to "
        "the first streamed chunk with text.",
    ])  # fmt: skip
