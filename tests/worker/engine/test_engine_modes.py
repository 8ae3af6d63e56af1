"""Engine modes with exact greedy parity: chunk cache under concurrency, eager SWA freeing, one
shared pool, all-SWA and all-full models, page sizes 1, 4 and 16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from tests.worker.models.hf_tiny import CONFIGS, hf_greedy, randomize
from worker.config import EngineConfig
from worker.engine.engine import Engine

GREEDY = dict(temperature=0.0, ignore_eos=True)
Greedy = Callable[[list[int], int], list[int]]


def assert_parity(
    engine: Engine, prompts: list[list[int]], max_tokens: int, greedy: Greedy
) -> None:
    """All prompts at once, invariants checked every step, each output equal to transformers'."""
    got: dict[str, list[int]] = {}
    rids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY),
                               on_delta=lambda d: got.setdefault(d.request_id, []).extend(d.token_ids))
            for p in prompts]  # fmt: skip
    run_checked(engine)
    for i, (rid, prompt) in enumerate(zip(rids, prompts)):
        assert got[rid] == greedy(prompt, max_tokens), f"request {i}"


def _mixed_prompts(n: int, seed: int, shared_len: int = 24) -> list[list[int]]:
    shared = tokens(shared_len, seed=seed)
    return [(shared if i % 2 else []) + tokens(4 + 7 * i % 37, seed=seed + 1 + i) for i in range(n)]


# ---- the hybrid oracle --------------------------------------------------------------------------
def test_chunk_cache_with_many_concurrent_requests(oracle: Oracle) -> None:
    """Radix cache off: twelve requests at once in small pools; nothing is ever reused."""
    engine = oracle.engine(enable_radix_cache=False, max_total_tokens=512, swa_full_tokens_ratio=0.25,
                           chunked_prefill_size=32, max_running_requests=12, swa_eviction_interval=4)  # fmt: skip
    assert_parity(engine, _mixed_prompts(12, seed=400), 10, oracle.greedy)
    s = engine.stats()
    assert s.cache_hit_tokens == 0 and s.swa.peak_used <= s.swa.total
    engine.check_integrity()
    assert (s.full.free, s.swa.free) == (s.full.total, s.swa.total)  # nothing is cached at all
    assert_all_free(engine)


def test_eager_swa_free_keeps_parity_and_frees_during_prefill(oracle: Oracle) -> None:
    """Eager freeing tombstones the out-of-window SWA of each chunk as it is inserted (the lazy
    default tombstones nothing before decode); outputs and prefix reuse stay exact."""
    prompt = tokens(160, seed=410)
    for eager in (False, True):
        engine = oracle.engine(
            eager_swa_free=eager, chunked_prefill_size=64, swa_eviction_interval=128
        )
        during_prefill = []

        def on_step(_: int, engine: Engine = engine, seen: list[int] = during_prefill) -> None:
            if any(not r.generated for r in engine.scheduler.running):
                seen.append(engine.stats().tombstone_tokens)

        engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
        run_checked(engine, on_step)
        assert len(during_prefill) == 2  # two chunks end mid-prompt
        assert (max(during_prefill) > 0) is eager, during_prefill
        assert_parity(engine, [prompt[:100] + tokens(9, seed=411), prompt + [5]], 8, oracle.greedy)
        assert engine.stats().cache_hit_tokens > 0
        assert_all_free(engine)


def test_one_shared_pool_when_hybrid_memory_is_disabled(oracle: Oracle) -> None:
    """disable_hybrid_swa_memory: one pool, SWA layers keep all their KV, outputs unchanged."""
    engine = oracle.engine(
        disable_hybrid_swa_memory=True, max_total_tokens=512, chunked_prefill_size=32
    )
    assert not engine.allocator.hybrid
    assert_parity(engine, _mixed_prompts(6, seed=420) + [tokens(120, seed=421)], 12, oracle.greedy)
    s = engine.stats()
    assert not s.hybrid and s.swa == s.full and s.tombstone_tokens == 0
    assert_all_free(engine)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_sizes(oracle: Oracle, page_size: int) -> None:
    """Shared prefixes, chunked prefill and SWA freeing at page sizes 1, 4 and 16."""
    engine = oracle.engine(page_size=page_size, max_total_tokens=1024, swa_full_tokens_ratio=0.125,
                           chunked_prefill_size=32, swa_eviction_interval=4)  # fmt: skip
    first = tokens(70, seed=430)
    engine.generate([first], SamplingParams(max_tokens=2, **GREEDY))
    prompts = [
        first[:48] + tokens(5, seed=431),
        first[:33] + tokens(20, seed=432),
        tokens(40, seed=433),
    ]
    assert_parity(engine, prompts, 20, oracle.greedy)
    assert engine.stats().cache_hit_tokens >= 32
    assert_all_free(engine)


# ---- all-SWA and all-full models ----------------------------------------------------------------
class Mistral:
    """A tiny Mistral saved to disk with its transformers greedy output."""

    def __init__(self, root: Path, sliding_window: int | None) -> None:
        from transformers import AutoModelForCausalLM

        config = CONFIGS["mistral"]()
        config.sliding_window = sliding_window
        torch.manual_seed(0)
        self.model = (
            AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
        )
        randomize(self.model, "mistral", seed=1)
        self.path = root / f"mistral_{sliding_window}"
        self.model.save_pretrained(self.path)
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        key = (tuple(prompt), max_new)
        if key not in self._cache:
            self._cache[key] = hf_greedy(self.model, prompt, max_new)[0]
        return self._cache[key]

    def engine(self, **overrides: Any) -> Engine:
        base: dict[str, Any] = dict(model=str(self.path), page_size=4, chunked_prefill_size=16)
        return Engine(EngineConfig(**(base | overrides)))


@pytest.fixture(scope="module")
def mistral_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine_mistral")


def test_all_swa_model(mistral_root: Path) -> None:
    """Every layer slides (window 8): the SWA pool alone bounds memory, prompts run far past it."""
    m = Mistral(mistral_root, sliding_window=9)
    engine = m.engine(max_total_tokens=48, swa_eviction_interval=4)
    assert engine.spec.is_all_swa and engine.allocator.swa_size == 48
    long = tokens(100, seed=440)
    assert_parity(
        engine, [long, long[:60] + tokens(7, seed=441), tokens(9, seed=442)], 16, m.greedy
    )
    assert engine.stats().swa.peak_used <= 48
    assert_parity(engine, [long[:90] + [3]], 6, m.greedy)  # reuses what the window rule allows
    assert_all_free(engine)


def test_all_full_model(mistral_root: Path) -> None:
    """No sliding layer: one full pool, plain prefix reuse, outputs unchanged."""
    m = Mistral(mistral_root, sliding_window=None)
    engine = m.engine(max_total_tokens=256)
    assert not engine.spec.has_swa and not engine.allocator.hybrid
    first = tokens(50, seed=450)
    assert_parity(engine, [first, tokens(30, seed=451)], 12, m.greedy)
    assert_parity(engine, [first[:40] + tokens(6, seed=452)], 12, m.greedy)
    assert engine.stats().cache_hit_tokens == 40
    assert_all_free(engine)
