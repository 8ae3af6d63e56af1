"""Seeded request streams for `swaserve bench routing`: who sends what, and when.

Three shapes of prefix sharing, each sized by `WorkloadSize` (requests scale with the workers):

- `multi_tenant`: K tenants, each with a long system prompt (1-2k tokens); every request is its
  tenant's system prompt + a short user turn; Poisson arrivals, tenants drawn Zipf-like (a few
  hot tenants, a long tail).
- `multi_turn`: C conversations; turn n+1's prompt = turn n's prompt + its answer + a new user
  turn, sent a think time after turn n finished (closed loop); all share a short system prompt.
- `agent_branching`: per task a long trunk (system + tools + context); branches fork off the
  trunk at varied depths (Poisson in time), then each branch runs a few steps closed-loop
  (previous prompt + answer + a tool result), like an agent exploring alternatives.
- `long_agent` (model presets only): agent sessions growing from ~8K to 64K tokens through tool
  calls, several at once per worker, a new one starting whenever one ends.

Token ids are random in [2, vocab) (0 and 1 stay out: 1 is what the simulated runner generates).
A workload is an object with `initial()` (the requests known at t=0, with arrival times) and
`follow_up(request, output, finish_s)` (the next request of a closed loop, or None).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from bench.sim_runner import SIM_VOCAB, StepCost


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: str
    tokens: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    session: str = ""  # conversation / branch id for closed loops
    step: int = 0  # turn or step number within the session


@dataclass(frozen=True)
class WorkloadSize:
    """How much traffic: `requests_per_worker` × workers requests, arriving at `load` × a rate
    that would keep the cluster about that busy without any cache hit (see `arrival_rate`)."""

    workers: int = 16
    requests_per_worker: int = 20
    load: float = 0.6
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.workers * self.requests_per_worker


class Workload(Protocol):
    name: str

    def initial(self) -> list[SimRequest]: ...

    def follow_up(
        self, req: SimRequest, output: list[int], finish_s: float
    ) -> SimRequest | None: ...


def arrival_rate(size: WorkloadSize, mean_prompt: float, max_tokens: int) -> float:
    """Requests/s that keep `size.load` of the cluster busy if nothing were cached, priced with
    `StepCost`'s defaults (one request alone: overhead + prefill, then `max_tokens` steps)."""
    c = StepCost()
    busy_s = c.seconds(int(mean_prompt), 0) + max_tokens * c.seconds(0, 1)
    return size.load * size.workers / busy_s


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(2, SIM_VOCAB) for _ in range(n))


def _step_rng(seed: int, session: str, step: int) -> random.Random:
    # NOTE: closed loops finish in a policy-dependent order; seeding per (session, step) gives
    # every policy the same follow-up content and think times whatever that order.
    return random.Random(f"{seed}/{session}/{step}")


@dataclass
class _Ids:
    prefix: str
    n: int = 0

    def next(self) -> str:
        self.n += 1
        return f"{self.prefix}-{self.n:05d}"


# ---------------------------------------------------------------- multi-tenant


@dataclass
class MultiTenant:
    size: WorkloadSize
    tenants_per_worker: float = 2.0
    system_tokens: tuple[int, int] = (1024, 2048)
    user_tokens: tuple[int, int] = (32, 128)
    max_tokens: int = 8
    zipf_s: float = 0.8
    name: str = "multi_tenant"

    def initial(self) -> list[SimRequest]:
        rng = random.Random(self.size.seed)
        k = max(1, round(self.tenants_per_worker * self.size.workers))
        systems = [_tokens(rng, rng.randint(*self.system_tokens)) for _ in range(k)]
        weights = [1.0 / (i + 1) ** self.zipf_s for i in range(k)]
        mean = sum(map(len, systems)) / k + sum(self.user_tokens) / 2
        rate = arrival_rate(self.size, mean, self.max_tokens)
        ids, t, out = _Ids("mt"), 0.0, []
        for _ in range(self.size.requests):
            t += rng.expovariate(rate)
            tenant = rng.choices(range(k), weights)[0]
            prompt = systems[tenant] + _tokens(rng, rng.randint(*self.user_tokens))
            out.append(SimRequest(ids.next(), prompt, self.max_tokens, t, f"tenant-{tenant}"))
        return out

    def follow_up(self, req: SimRequest, output: list[int], finish_s: float) -> SimRequest | None:
        return None


# ---------------------------------------------------------------- multi-turn chats


@dataclass
class MultiTurn:
    size: WorkloadSize
    turns: tuple[int, int] = (3, 7)
    system_tokens: int = 256
    first_user_tokens: tuple[int, int] = (64, 256)
    user_tokens: tuple[int, int] = (32, 128)
    max_tokens: int = 32
    think_s: float = 2.0  # mean of an exponential think time between turns
    name: str = "multi_turn"
    _turns: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _ids: _Ids = field(default_factory=lambda: _Ids("chat"), init=False, repr=False)

    def initial(self) -> list[SimRequest]:
        rng = random.Random(self.size.seed)
        mean_turns = sum(self.turns) / 2
        chats = max(1, round(self.size.requests / mean_turns))
        system = _tokens(rng, self.system_tokens)
        mean_prompt = self.system_tokens + mean_turns * (
            self.max_tokens + sum(self.user_tokens) / 2
        )
        # Closed loop: a chat's turns are spread over its think times, so start them over the
        # span in which the open-loop rate would have sent them.
        span = self.size.requests / arrival_rate(self.size, mean_prompt, self.max_tokens)
        out = []
        for c in range(chats):
            session = f"chat-{c:04d}"
            self._turns[session] = rng.randint(*self.turns)
            prompt = system + _tokens(rng, rng.randint(*self.first_user_tokens))
            start = rng.uniform(0.0, max(span - mean_turns * self.think_s, span / 4))
            out.append(SimRequest(self._ids.next(), prompt, self.max_tokens, start, session, 0))
        return sorted(out, key=lambda r: r.arrival_s)

    def follow_up(self, req: SimRequest, output: list[int], finish_s: float) -> SimRequest | None:
        if req.step + 1 >= self._turns[req.session]:
            return None
        rng = _step_rng(self.size.seed, req.session, req.step + 1)
        prompt = req.tokens + tuple(output) + _tokens(rng, rng.randint(*self.user_tokens))
        arrival = finish_s + rng.expovariate(1.0 / self.think_s)
        return SimRequest(
            self._ids.next(), prompt, self.max_tokens, arrival, req.session, req.step + 1
        )


# ---------------------------------------------------------------- agent-style branching


@dataclass
class AgentBranching:
    size: WorkloadSize
    tasks_per_worker: float = 0.5
    trunk_tokens: tuple[int, int] = (1536, 3072)
    branch_tokens: tuple[int, int] = (64, 256)
    tool_tokens: tuple[int, int] = (64, 192)
    steps: tuple[int, int] = (2, 5)  # requests per branch (the first forks off the trunk)
    fork_depth: tuple[float, float] = (0.3, 1.0)  # where on the trunk a branch forks
    max_tokens: int = 16
    tool_s: float = 0.5  # mean tool latency between a branch's steps
    name: str = "agent_branching"
    _steps: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _ids: _Ids = field(default_factory=lambda: _Ids("agent"), init=False, repr=False)

    def initial(self) -> list[SimRequest]:
        rng = random.Random(self.size.seed)
        tasks = max(1, round(self.tasks_per_worker * self.size.workers))
        trunks = [_tokens(rng, rng.randint(*self.trunk_tokens)) for _ in range(tasks)]
        mean_steps = sum(self.steps) / 2
        branches = max(1, round(self.size.requests / mean_steps))
        mean_trunk = sum(map(len, trunks)) / tasks
        mean_prompt = mean_trunk * sum(self.fork_depth) / 2 + sum(self.branch_tokens) / 2
        rate = arrival_rate(self.size, mean_prompt, self.max_tokens) / mean_steps
        t, out = 0.0, []
        for b in range(branches):
            t += rng.expovariate(rate)
            task = rng.randrange(tasks)
            trunk = trunks[task]
            depth = int(len(trunk) * rng.uniform(*self.fork_depth))
            prompt = trunk[:depth] + _tokens(rng, rng.randint(*self.branch_tokens))
            session = f"task-{task:03d}/branch-{b:04d}"
            self._steps[session] = rng.randint(*self.steps)
            out.append(SimRequest(self._ids.next(), prompt, self.max_tokens, t, session, 0))
        return out

    def follow_up(self, req: SimRequest, output: list[int], finish_s: float) -> SimRequest | None:
        if req.step + 1 >= self._steps[req.session]:
            return None
        rng = _step_rng(self.size.seed, req.session, req.step + 1)
        prompt = req.tokens + tuple(output) + _tokens(rng, rng.randint(*self.tool_tokens))
        arrival = finish_s + rng.expovariate(1.0 / self.tool_s)
        return SimRequest(
            self._ids.next(), prompt, self.max_tokens, arrival, req.session, req.step + 1
        )


# ---------------------------------------------------------------- long-context agents


@dataclass
class LongAgent:
    """Agent sessions that grow from ~`start_tokens` to `end_tokens` through tool calls: each
    step's prompt is the previous prompt + the model's tool call (`max_tokens`) + the tool's
    result. `concurrent_per_worker` × workers sessions run at once (closed loop); when one
    ends the next starts, until `sessions_per_worker` × workers sessions have run. Session k's
    content is seeded by k alone, so every policy sees the same sessions."""

    size: WorkloadSize
    sessions_per_worker: float = 12.0
    concurrent_per_worker: float = 3.0
    start_tokens: tuple[int, int] = (6144, 10240)
    end_tokens: int = 65536
    tool_tokens: tuple[int, int] = (2048, 6144)
    max_tokens: int = 64
    tool_s: float = 1.0  # mean tool latency between steps
    name: str = "long_agent"
    _started: int = field(default=0, init=False, repr=False)
    _ids: _Ids = field(default_factory=lambda: _Ids("long"), init=False, repr=False)

    @property
    def sessions(self) -> int:
        return max(1, round(self.sessions_per_worker * self.size.workers))

    def initial(self) -> list[SimRequest]:
        rng = random.Random(self.size.seed)
        n = min(self.sessions, max(1, round(self.concurrent_per_worker * self.size.workers)))
        return [self._session(rng.uniform(0.0, self.tool_s * n / self.size.workers)) for _ in range(n)]

    def _session(self, at: float) -> SimRequest:
        k, self._started = self._started, self._started + 1
        rng = _step_rng(self.size.seed, f"long-{k}", 0)
        prompt = _tokens(rng, rng.randint(*self.start_tokens))
        return SimRequest(self._ids.next(), prompt, self.max_tokens, at, f"long-{k:04d}", 0)

    def follow_up(self, req: SimRequest, output: list[int], finish_s: float) -> SimRequest | None:
        rng = _step_rng(self.size.seed, req.session, req.step + 1)
        tool = _tokens(rng, rng.randint(*self.tool_tokens))
        arrival = finish_s + rng.expovariate(1.0 / self.tool_s)
        if len(req.tokens) + len(output) + len(tool) > self.end_tokens - self.max_tokens:
            # This session is done: the next one takes its place (if any are left).
            return self._session(arrival) if self._started < self.sessions else None
        prompt = req.tokens + tuple(output) + tool
        return SimRequest(
            self._ids.next(), prompt, self.max_tokens, arrival, req.session, req.step + 1
        )


WORKLOADS: dict[str, Callable[[WorkloadSize], Workload]] = {
    "multi_tenant": MultiTenant,
    "multi_turn": MultiTurn,
    "agent_branching": AgentBranching,
}


def make_workload(name: str, size: WorkloadSize) -> Workload:
    try:
        return WORKLOADS[name](size)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None
