"""Model presets for `swaserve bench routing`: an SGLang-like stack, an SGLang-HiCache-like one
and swaserve's full stack, across SWA pool ratios, on the layer plans of real models
(docs/design.md §9.5, §9.8, §9.9, §13.3).

| stack | SWA eviction | tombstone repair | host tier | routing |
|---|---|---|---|---|
| `sglang_like` | `lru` (SGLang's SWA LRU: unlocked leaves deleted) | off | none | `prefix` (full-KV match) |
| `hicache_like` | `lru` (evicted KV, full and SWA, offloaded) | off | 4x device KV | `prefix` (full-KV match, host KV free: the window ignored) |
| `swaserve` | `tail_first` (interior SWA offloaded first) | auto | 4x device KV | `swa_prefix` (load / repair / recompute priced) |

Pools (per worker) come from `plan_pools` for the preset on a stated fraction of an 80 GiB KV
budget (bf16, page 16): ratios 0.05, 0.1, 0.25, and `roomy`: the ratio-0.1 full pool with an SWA
pool as large and no host tier for any stack (more memory than the budget; SWA never runs short:
the reference). The host tier is `HOST_KV_MULTIPLE` (4) x that device budget per worker (the
product's default on CUDA), split into as many SWA tokens as full ones (`plan_host_pools` with
`host_swa_full_tokens_ratio` 1, the default); a load costs its bytes at 50 GB/s in the virtual
step time and in the prices the engines and the router choose with (`StepCost`).
Each workload is scaled so its distinct tokens fill the full pool several times over. The
long-context agent needs the larger fraction: its sessions reach 64K tokens and several run per
worker.

Prefill cost is counted in token-layers: every prefilled token (repair rows included) runs on
all the model's layers. Capacity is what the ratio buys: concurrent requests of `CONTEXT`
tokens the admission charges admit on the whole 80 GiB (`bench.memory.admission.admitted`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from bench.configs import CONFIG_DIR
from bench.memory.admission import MemorySettings, admitted
from bench.routing.figures import RunFigures, summarize
from bench.routing.sim import SimCluster, Simulation
from bench.routing.workloads import (
    AgentBranching,
    LongAgent,
    MultiTenant,
    MultiTurn,
    Workload,
    WorkloadSize,
)
from bench.sim_runner import SIM_DTYPE_BYTES
from worker.assembly.host import HOST_KV_MULTIPLE
from worker.models.spec import ModelSpec

PRESETS = {"gpt-oss-120b": "gpt-oss-120b.json", "mimo-v2-flash": "mimo-v2-flash.json"}
RATIOS = (0.05, 0.1, 0.25)
TARGET_RATIO = 0.1
ROOMY = "roomy"
POOLS = (*(f"r{r:g}" for r in RATIOS), ROOMY)
CONTEXT = 32_768  # the capacity column: concurrent requests of this many tokens
GIB = 1024**3


@dataclass(frozen=True)
class Stack:
    name: str
    policy: str
    swa_eviction_policy: str
    tombstone_repair: str
    host_tier: bool  # HOST_KV_MULTIPLE x the device budget (not on the roomy pool)


STACKS = (
    Stack("sglang_like", "prefix", "lru", "off", host_tier=False),
    Stack("hicache_like", "prefix", "lru", "off", host_tier=True),
    Stack("swaserve", "swa_prefix", "tail_first", "auto", host_tier=True),
)
STACK_NAMES = tuple(s.name for s in STACKS)


@dataclass(frozen=True)
class ScaledWorkload:
    """One workload as the presets run it: the fraction of the KV budget each worker gets, the
    prefill chunk (it grows with the pool), the cluster size, and the scaled generator."""

    fraction: float  # of StackSettings.budget_gib per worker
    chunk: int  # chunked_prefill_size
    workers: int
    make: Callable[[WorkloadSize], Workload]


SHORT, LONG = 1 / 64, 1 / 8
SCALED: dict[str, ScaledWorkload] = {
    # Distinct prompt tokens ~2x the cluster's ratio-0.1 full pools (the `fill` column).
    "multi_tenant": ScaledWorkload(SHORT, 512, 4, lambda s: MultiTenant(s, tenants_per_worker=36)),
    "multi_turn": ScaledWorkload(SHORT, 512, 4, lambda s: MultiTurn(
        s, turns=(4, 10), first_user_tokens=(256, 1024), user_tokens=(128, 384),
    )),  # fmt: skip
    "agent_branching": ScaledWorkload(
        SHORT, 512, 4, lambda s: AgentBranching(s, tasks_per_worker=12)
    ),
    # 12 sessions per worker, 3 at once (their 64K fit the full pool), 8K -> 64K: ~3x the pool.
    "long_agent": ScaledWorkload(LONG, 8192, 2, lambda s: LongAgent(
        s, sessions_per_worker=12, concurrent_per_worker=4, tool_tokens=(4096, 8192), max_tokens=32,
    )),  # fmt: skip
}


@dataclass(frozen=True)
class StackSettings:
    models: tuple[str, ...] = tuple(PRESETS)
    workloads: tuple[str, ...] = tuple(SCALED)
    requests_per_worker: int = 250  # short workloads (long_agent counts sessions)
    load: float = 0.6
    budget_gib: float = 80.0
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.models if m not in PRESETS] + [
            w for w in self.workloads if w not in SCALED
        ]
        if bad:
            raise ValueError(f"unknown preset or workload {bad}: presets {sorted(PRESETS)}, "
                             f"workloads {sorted(SCALED)}")  # fmt: skip
        if self.requests_per_worker < 1:
            raise ValueError("--stack-requests-per-worker must be >= 1")

    def budget_bytes(self, workload: str) -> int:
        return int(self.budget_gib * GIB * SCALED[workload].fraction)


@dataclass(frozen=True)
class StackJob:
    model: str
    workload: str
    pool: str
    stack: str


@dataclass(frozen=True)
class StackRun:
    model: str
    workload: str
    pool: str
    stack: str
    full_tokens: int  # per worker
    swa_tokens: int
    host_full_tokens: int  # per worker; 0: no host tier
    host_swa_tokens: int
    layers: int
    token_layers: int  # prefill tokens x layers (repair rows included)
    capacity: int  # concurrent CONTEXT-token requests on the whole budget at this pool's ratio
    distinct_tokens: int  # the workload's distinct prompt tokens (a trie over every prompt)
    figures: RunFigures

    @property
    def fill(self) -> float:
        """Distinct tokens over the cluster's full pools: how many times the traffic fills them."""
        return self.distinct_tokens / (self.figures.workers * self.full_tokens)


@functools.cache
def preset_spec(model: str) -> ModelSpec:
    from worker.models.hf_config import load_spec

    return load_spec(CONFIG_DIR / PRESETS[model])


def ratio_of(pool: str) -> float:
    return 1.0 if pool == ROOMY else float(pool[1:])


def pool_tokens(spec: ModelSpec, budget: int, pool: str, page: int) -> tuple[int, int]:
    """(full, SWA) tokens per worker; roomy: the ratio-0.1 full pool, SWA as large."""
    from worker.kv.memory_plan import plan_pools

    ratio = TARGET_RATIO if pool == ROOMY else ratio_of(pool)
    plan = plan_pools(spec, page_size=page, dtype_bytes=SIM_DTYPE_BYTES, swa_full_tokens_ratio=ratio,
                      kv_cache_bytes=budget)  # fmt: skip
    return (plan.full_tokens, plan.full_tokens) if pool == ROOMY else (plan.full_tokens, plan.swa_tokens)


def capacity(spec: ModelSpec, pool: str, s: StackSettings) -> int:
    from worker.kv.memory_plan import plan_pools

    plan = plan_pools(spec, page_size=s.page_size, dtype_bytes=2,
                      swa_full_tokens_ratio=ratio_of(pool), kv_cache_bytes=int(s.budget_gib * GIB))  # fmt: skip
    return admitted(plan, spec, CONTEXT, MemorySettings(page_size=s.page_size))


def plan_stack_jobs(s: StackSettings) -> list[StackJob]:
    return [StackJob(m, w, p, st) for m in s.models for w in s.workloads for p in POOLS
            for st in STACK_NAMES]  # fmt: skip


def run_stack_job(s: StackSettings, job: StackJob) -> StackRun:
    """One simulation (top-level: `--jobs` runs it in a spawned process)."""
    import torch

    torch.set_num_threads(1)
    spec = preset_spec(job.model)
    assert spec.window is not None
    stack = next(x for x in STACKS if x.name == job.stack)
    scaled = SCALED[job.workload]
    budget = s.budget_bytes(job.workload)
    full, swa = pool_tokens(spec, budget, job.pool, s.page_size)
    host = HOST_KV_MULTIPLE * budget if stack.host_tier and job.pool != ROOMY else 0
    cluster = SimCluster(
        workers=scaled.workers, page_size=s.page_size, window=spec.window, full_tokens=full,
        swa_ratio=1.0 if job.pool == ROOMY else ratio_of(job.pool),
        chunked_prefill_size=scaled.chunk, swa_eviction_policy=stack.swa_eviction_policy,
        tombstone_repair=stack.tombstone_repair, host_kv_bytes=host, spec=spec,
    )  # fmt: skip
    size = WorkloadSize(scaled.workers, s.requests_per_worker, s.load, s.seed)
    sim = Simulation(cluster, stack.policy, scaled.make(size))
    outcome = sim.run()
    figures = summarize(outcome, job.workload, job.pool)
    distinct = distinct_tokens([t.req.tokens for t in outcome.tracks])
    host_full, host_swa = sim.host_tokens()
    return StackRun(
        job.model, job.workload, job.pool, job.stack, full, swa, host_full, host_swa,
        spec.num_layers, figures.prefill_tokens * spec.num_layers, capacity(spec, job.pool, s),
        distinct, figures,
    )  # fmt: skip


def distinct_tokens(prompts: list[tuple[int, ...]]) -> int:
    """Tokens of a trie over the prompts: sorted, each adds what it does not share with the
    one before it."""
    total = 0
    prev: tuple[int, ...] = ()
    for p in sorted(set(prompts)):
        n = min(len(p), len(prev))
        lcp = next((i for i in range(n) if p[i] != prev[i]), n)
        total += len(p) - lcp
        prev = p
    return total
