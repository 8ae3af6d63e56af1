"""Engine.stats() counters that the metrics endpoint exports: evictions and tombstones."""

from __future__ import annotations

from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from worker.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_eviction_counters_account_for_every_cached_token(oracle: Oracle) -> None:
    """Distinct prompts one after another in a small pool: every token a finished request left
    in the tree is either still cached or counted as evicted."""
    engine = oracle.engine(
        max_total_tokens=256, swa_full_tokens_ratio=0.25, chunked_prefill_size=64
    )
    P, inserted = engine.config.page_size, 0
    for i in range(8):
        prompt = tokens(40 + i, seed=500 + i)
        engine.add_request(prompt, SamplingParams(max_tokens=10, **GREEDY))
        run_checked(engine)
        committed = len(prompt) + 10 - 1  # the last sampled token is never fed back
        inserted += committed - committed % P
    s = engine.stats()
    assert s.full_evicted_tokens > 0 and s.swa_evicted_tokens > 0
    assert s.full.evictable + s.full_evicted_tokens == inserted
    assert_all_free(engine)


def test_tombstone_tokens_equal_a_recount_of_the_tree(oracle: Oracle) -> None:
    """The tombstone gauge counts exactly the cached tokens whose SWA KV is gone."""
    engine = oracle.engine(swa_eviction_interval=4)
    engine.generate([tokens(120, seed=510)], SamplingParams(max_tokens=48, **GREEDY))
    recount = sum(len(n) for n in engine.cache.tree.iter_nodes() if n.swa is None)
    assert engine.stats().tombstone_tokens == recount > 0
    assert_all_free(engine)
    assert engine.stats().tombstone_tokens == 0
