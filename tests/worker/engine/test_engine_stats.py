"""Engine.stats() counters that the metrics endpoint exports: evictions and tombstones."""

from __future__ import annotations

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens

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


class _OffLimits:
    """Stands in for the scheduler after the snapshot: any read from another thread would land here."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"stats() read the live scheduler ({name!r})")


def test_stats_is_the_snapshot_of_the_last_step(oracle: Oracle) -> None:
    """stats() returns the frozen snapshot the last step published: the same object until the
    next step, never a read of the live scheduler, pools or cache."""
    import dataclasses

    import pytest

    engine = oracle.engine()
    engine.add_request(tokens(30, seed=520), SamplingParams(max_tokens=4, **GREEDY))
    engine.step()  # prefill: one request running
    first = engine.stats()
    assert first is engine.stats() and first.running == 1 and first.steps == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.running = 0  # type: ignore[misc]
    live, engine.scheduler = engine.scheduler, _OffLimits()  # type: ignore[assignment]
    assert engine.stats() is first
    engine.scheduler = live
    engine.step()
    assert engine.stats() is not first and engine.stats().steps == 2
    run_checked(engine)
    done = engine.stats()
    assert (done.running, done.waiting, done.generated_tokens) == (0, 0, 4)


def test_stats_report_queued_prefill_and_running_decodes(oracle: Oracle) -> None:
    """The load the router reads: prompt tokens still to compute and requests decoding."""
    engine = oracle.engine(chunked_prefill_size=16)
    engine.add_request(tokens(20, seed=530), SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request(tokens(40, seed=531), SamplingParams(max_tokens=8, **GREEDY))
    engine.step()  # 16 tokens of the first prompt; the second waits
    s = engine.stats()
    assert (s.waiting, s.running, s.running_decodes) == (1, 1, 0)
    assert s.queued_prefill_tokens == (20 - 16) + 40
    engine.step()  # the first finishes its prompt (and samples); 12 tokens of the second
    engine.step()
    s = engine.stats()
    assert s.running_decodes == 1 and s.queued_prefill_tokens == 40 - 12 - 16
    run_checked(engine)
