"""A tiny hybrid model (MiMo-V2-Flash: SWA + full layers with different KV heads, sinks) whose
context is long enough for prompts far beyond the SWA pool, and its transformers oracle."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.worker.models.hf_tiny import ARCHS, CONFIGS, TinyHF, hf_greedy, make_tiny, randomize
from worker.config import EngineConfig
from worker.engine.engine import Engine

WINDOW = 16  # HF sliding_window 17


class Oracle:
    def __init__(self, root: Path) -> None:
        from transformers import AutoModelForCausalLM

        config = CONFIGS["mimo_v2_flash"]()
        config.max_position_embeddings = 4096
        config.sliding_window = WINDOW + 1
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
        randomize(self.model, "mimo_v2_flash", seed=0)
        self.path = root / "mimo_long"
        self.model.save_pretrained(self.path)
        self.overlap = "off"  # the engines' overlap_schedule (the `overlap` fixture sets it)

    @functools.cache  # noqa: B019 - one oracle per session
    def _greedy(self, prompt: tuple[int, ...], max_new: int) -> tuple[int, ...]:
        return tuple(hf_greedy(self.model, list(prompt), max_new)[0])

    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        return list(self._greedy(tuple(prompt), max_new))

    def engine(self, **overrides: object) -> Engine:
        base = dict(model=str(self.path), page_size=4, max_total_tokens=4096,
                    swa_full_tokens_ratio=0.25, chunked_prefill_size=64, swa_eviction_interval=8,
                    overlap_schedule=self.overlap)  # fmt: skip
        base.update(overrides)
        return Engine(EngineConfig(**base))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # NOTE: the models here are tiny; on a shared, busy box torch's intra-op threads only contend
    # (a step takes ~20x longer with 2 threads than with 1).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["off", "on"], ids=["overlap_off", "overlap_on"])
def overlap(request: pytest.FixtureRequest, oracle: Oracle) -> Iterator[str]:
    """Run a test with overlap scheduling off and on (docs/design.md §11.8): a module opts in
    with ``pytestmark = pytest.mark.usefixtures("overlap")``."""
    oracle.overlap = request.param
    yield request.param
    oracle.overlap = "off"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyHF]:
    """Every supported architecture as a tiny random transformers model (fp32) on disk."""
    root = tmp_path_factory.mktemp("archs")
    return {a: make_tiny(a, root) for a in ARCHS}


@pytest.fixture(scope="session")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    return Oracle(tmp_path_factory.mktemp("engine_models"))


def tokens(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (length,), generator=gen).tolist()


def run_checked(engine: Engine, on_step: Callable[[int], None] | None = None, limit: int = 20000) -> None:
    """Step until idle, checking every invariant after every step."""
    for i in range(limit):
        if not engine.has_work():
            return
        engine.step()
        engine.check_integrity()
        if on_step is not None:
            on_step(i)
    raise AssertionError(f"engine still busy after {limit} steps")


def assert_all_free(engine: Engine) -> None:
    """Idle engine: invariants hold, and after a flush both pools are entirely free."""
    assert not engine.has_work(), "the engine still has requests"
    engine.check_integrity()
    assert engine.flush_cache()
    engine.check_integrity()
    s = engine.stats()
    assert (s.full.free, s.swa.free) == (s.full.total, s.swa.total), f"after flush: {s.full} {s.swa}"
    assert (s.full.used, s.swa.used) == (0, 0)
