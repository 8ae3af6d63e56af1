"""The routing policies and their registry.

| policy | ranks by | reports as predicted cached tokens |
|---|---|---|
| `swa_prefix` (default) | cost model with what the worker reuses (window rule over both tiers, the load / repair / recompute choice; repair rows charged as compute, loads at their `TierCosts`) | reused (+ repaired, loaded) |
| `prefix` | cost model with the *full* match (tombstones count as hits, host KV is free) — the baseline other routers implement | full match (its belief) |
| `least_loaded` | load + capacity, no cache credit | reused (informational) |
| `round_robin` | rotation over candidates sorted by id | reused (informational) |

Ties (equal cost and load) rotate with every decision, so a cold or idle fleet is spread evenly
instead of sending everything to the first candidate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from router.cost import (
    CostWeights,
    WorkerView,
    capacity_tokens,
    load_tokens,
    overloaded,
    request_cost,
)


@dataclass(frozen=True, slots=True)
class RequestView:
    prompt_tokens: int
    max_new_tokens: int = 0


class Ranking(NamedTuple):
    """A policy's answer: positions in the views it was given, best first, and each position's
    cost. NOTE: two lists, not a tuple per candidate: one allocation fewer per candidate."""

    order: list[int]
    costs: list[float]


class Policy(ABC):
    """Ranks candidate workers for one request. Holds only a rotation counter."""

    name: ClassVar[str]

    def __init__(self, weights: CostWeights | None = None) -> None:
        self.weights = weights or CostWeights()
        self._turn = 0

    @abstractmethod
    def rank(self, request: RequestView, views: Sequence[WorkerView]) -> Ranking:
        """Every view exactly once, best first.

        Args:
            request: prompt length and the expected number of new tokens.
            views: the candidates, in a stable order (sorted by worker id).
        Returns:
            the positions in `views`, lowest cost first, and the cost of each position.
        """

    def predicted(self, view: WorkerView) -> int:
        """Cached tokens this policy predicts for the worker (header and metrics)."""
        return view.valid_cached

    def predicted_repaired(self, view: WorkerView) -> int:
        """Repaired tokens this policy predicts for the worker (docs/design.md §9.8)."""
        return view.repaired

    def predicted_loaded(self, view: WorkerView) -> int:
        """Tokens of KV this policy predicts the worker loads from its host tier, full and SWA
        counted apart (`Reuse.loaded_full + loaded_swa`, docs/design.md §9.9)."""
        return view.loaded_full + view.loaded_swa

    def _turn_next(self) -> int:
        """This decision's rotation (ties go to the candidate at `(i - turn) % n` lowest)."""
        turn, self._turn = self._turn, self._turn + 1
        return turn

    def _order(self, costs: list[float], keys: Sequence[tuple[float, ...]]) -> Ranking:
        """Sort by `keys` (each ending with the rotation term `(i - turn) % n`).

        NOTE: the caller builds each key with its rotation in one tuple: one allocation per
        candidate instead of two.
        """
        return Ranking(sorted(range(len(keys)), key=keys.__getitem__), costs)


class _CachePolicy(Policy):
    """The cost model with a cache credit; subclasses say which match they believe."""

    @abstractmethod
    def cached(self, view: WorkerView) -> int: ...

    def host_load(self, view: WorkerView) -> float:
        """What it believes the host-tier copies cost, in tokens of prefill."""
        return view.host_load_cost

    def predicted(self, view: WorkerView) -> int:
        return self.cached(view)

    def rank(self, request: RequestView, views: Sequence[WorkerView]) -> Ranking:
        w = self.weights
        prompt, max_new = request.prompt_tokens, request.max_new_tokens
        loads = [load_tokens(v, w) for v in views]
        cached, host_load = self.cached, self.host_load
        costs = [
            request_cost(v, cached(v), prompt, max_new, w, load, host_load(v))
            for v, load in zip(views, loads)
        ]
        over = overloaded(loads, w)
        n, turn = len(views), self._turn_next()
        keys = [(float(over[i]), costs[i], loads[i], (i - turn) % n) for i in range(n)]
        return self._order(costs, keys)


class SwaPrefixPolicy(_CachePolicy):
    name = "swa_prefix"

    def cached(self, view: WorkerView) -> int:
        return view.valid_cached


class PrefixPolicy(_CachePolicy):
    name = "prefix"

    def cached(self, view: WorkerView) -> int:
        return view.full_cached

    def host_load(self, view: WorkerView) -> float:
        return 0.0  # host-resident KV counts as a plain hit

    def predicted_repaired(self, view: WorkerView) -> int:
        return 0  # it believes the whole full match is reused

    def predicted_loaded(self, view: WorkerView) -> int:
        return 0


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def rank(self, request: RequestView, views: Sequence[WorkerView]) -> Ranking:
        w = self.weights
        costs = [
            load_tokens(v, w) + capacity_tokens(v, request.prompt_tokens, request.max_new_tokens, w)
            for v in views
        ]
        n, turn = len(views), self._turn_next()
        return self._order(costs, [(c, (i - turn) % n) for i, c in enumerate(costs)])


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def rank(self, request: RequestView, views: Sequence[WorkerView]) -> Ranking:
        n, turn = len(views), self._turn_next()
        start = turn % n if n else 0  # the rotation alone: candidate `start` first, then in order
        return Ranking([*range(start, n), *range(start)], [0.0] * n)


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (SwaPrefixPolicy, PrefixPolicy, LeastLoadedPolicy, RoundRobinPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)  # the CLI's choices and ServeConfig's values
DEFAULT_POLICY = SwaPrefixPolicy.name


def make_policy(name: str = DEFAULT_POLICY, weights: CostWeights | None = None) -> Policy:
    try:
        return POLICIES[name](weights)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
