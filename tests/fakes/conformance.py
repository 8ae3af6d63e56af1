"""Static checks, run by mypy (tests/test_typing.py): each stand-in implements the protocol of
the part it replaces, so a fake that drifts from the real interface fails the type check.

Nothing here runs; the functions exist for their signatures.
"""

from __future__ import annotations

from bench.sim_runner import SimRunner
from deploy.replica.ranks import RayRankLauncher, RayRanks
from tests.fakes.fake_engine import FakeEngine
from worker.assembly.rank_processes import ProcessLauncher, ProcessRanks
from worker.assembly.ranks import RankLauncher, Ranks
from worker.engine.protocols import EngineClient
from worker.hosts.async_engine import AsyncEngine
from worker.parallel.runner import TPRunner
from worker.runner.base import Runner
from worker.runner.model_runner import ModelRunner
from worker.runner.standin import StandInRunner


def fake_engine_is_an_engine_client(engine: FakeEngine) -> EngineClient:
    return engine


def async_engine_is_an_engine_client(engine: AsyncEngine) -> EngineClient:
    return engine


def sim_runner_is_a_runner(runner: SimRunner) -> Runner:
    return runner


def standin_runner_is_a_runner(runner: StandInRunner) -> Runner:
    return runner


def model_runner_is_a_runner(runner: ModelRunner) -> Runner:
    return runner


def tp_runner_is_a_runner(runner: TPRunner) -> Runner:
    return runner


def local_processes_launch_ranks(launcher: ProcessLauncher, ranks: ProcessRanks) -> tuple[RankLauncher, Ranks]:
    return launcher, ranks


def ray_actors_launch_ranks(launcher: RayRankLauncher, ranks: RayRanks) -> tuple[RankLauncher, Ranks]:
    return launcher, ranks


class _EngineWithoutStats:
    """An engine that forgot `stats()` (and everything else): never an EngineClient."""


def the_checker_refuses_an_incomplete_engine(engine: _EngineWithoutStats) -> EngineClient:
    # NOTE: mypy must report this line; `warn_unused_ignores` makes the run fail if it stops
    # doing so (the check would then pass anything).
    return engine  # type: ignore[return-value]
