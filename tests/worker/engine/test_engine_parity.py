"""The engine computes exactly what transformers computes, while its pools stay small."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import WINDOW, Oracle, run_checked, tokens

pytestmark = pytest.mark.usefixtures("overlap")  # every test with overlap off and on

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "chunk_cache"])
def test_prompt_far_longer_than_the_swa_pool(oracle: Oracle, radix: bool) -> None:
    P, interval, chunk = 4, 8, 64
    engine = oracle.engine(page_size=P, max_total_tokens=4096, swa_full_tokens_ratio=256 / 4096,
                           chunked_prefill_size=chunk, swa_eviction_interval=interval,
                           enable_radix_cache=radix)  # fmt: skip
    assert engine.allocator.swa_size == 256
    prompt = tokens(2048, seed=1)
    out = engine.generate([prompt], SamplingParams(max_tokens=128, **GREEDY))[0]
    assert out.token_ids == oracle.greedy(prompt, 128)
    peak = engine.stats().swa.peak_used
    assert peak <= WINDOW + interval + chunk + 2 * P, f"SWA peak {peak}"
    engine.check_integrity()
    assert engine.flush_cache()
    s = engine.stats()
    assert (s.full.free, s.swa.free) == (s.full.total, s.swa.total)


@pytest.mark.slow
def test_sixteen_concurrent_requests_match_each_alone(oracle: Oracle) -> None:
    engine = oracle.engine(chunked_prefill_size=32, max_running_requests=16)
    shared = tokens(40, seed=7)
    prompts = []
    for i in range(16):
        if i % 3 == 0:
            prompts.append(shared + tokens(5 + i, seed=100 + i))
        else:
            prompts.append(tokens(3 + 9 * i, seed=200 + i))
    got: dict[str, list[int]] = {}
    rids = []
    for i, p in enumerate(prompts):
        rid = engine.add_request(p, SamplingParams(max_tokens=12 + i % 5, **GREEDY),
                                 on_delta=lambda d: got.setdefault(d.request_id, []).extend(d.token_ids))  # fmt: skip
        rids.append(rid)
    run_checked(engine)
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        assert got[rid] == oracle.greedy(p, 12 + i % 5), f"request {i}"
    assert engine.flush_cache()
    s = engine.stats()
    assert (s.full.free, s.swa.free) == (s.full.total, s.swa.total)
    assert s.cache_hit_tokens > 0  # the shared prefix was reused


def test_shared_prefix_reports_the_valid_match(oracle: Oracle) -> None:
    engine = oracle.engine(tombstone_repair="off")  # the repair path: test_engine_repair.py
    first = tokens(96, seed=3)
    engine.generate([first], SamplingParams(max_tokens=4, **GREEDY))
    second = first[:64] + tokens(20, seed=4)
    expected = _valid_match_from_snapshot(engine, second)
    assert expected >= 48  # the shared part minus what decode freed at its tail
    out = engine.generate([second], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert out.cached_tokens == expected
    assert out.token_ids == oracle.greedy(second, 16)
    engine.check_integrity()

    # SWA pressure: tombstone the oldest pages of the cached prefix.
    engine.cache.evict(0, engine.cache.swa_evictable)
    before = expected
    third = second[:-1] + [7]
    expected = _valid_match_from_snapshot(engine, third)
    assert expected < before
    out = engine.generate([third], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert out.cached_tokens == expected
    assert out.token_ids == oracle.greedy(third, 16)
    engine.check_integrity()


def _valid_match_from_snapshot(engine, prompt: list[int]) -> int:
    """The window rule applied page by page to the cache's published state (independent of
    the tree's own match code)."""
    from core.events import PageState, page_hashes

    P, window = engine.config.page_size, engine.spec.window
    pages = engine.cache_snapshot()
    best, run, seen_tomb = 0, 0, False
    for i, h in enumerate(page_hashes(prompt[: len(prompt) - 1], P)):
        state = pages.get(h)
        if state is None:
            break
        if state is PageState.TOMBSTONE:
            seen_tomb, run = True, 0
        else:
            run += P
        if not seen_tomb or run >= window:
            best = (i + 1) * P
    return best


def test_a_prompt_in_one_chunk_stays_reusable_after_its_request_decodes(oracle: Oracle) -> None:
    """The prompt goes into the tree when its prefill ends, so decoding (which frees the
    request's own out-of-window SWA) never tombstones it: a second request sharing it reuses
    all its pages."""
    engine = oracle.engine(chunked_prefill_size=256, swa_eviction_interval=4)
    system = tokens(96, seed=21)
    engine.generate([system + tokens(8, seed=22)], SamplingParams(max_tokens=40, **GREEDY))
    second = system + tokens(8, seed=23)
    out = engine.generate([second], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert out.cached_tokens == 96  # the whole shared prompt
    assert out.token_ids == oracle.greedy(second, 8)
    engine.check_integrity()


def test_stats_report_queued_prefill_and_decodes(oracle: Oracle) -> None:
    engine = oracle.engine(chunked_prefill_size=16, max_running_requests=1)
    for i in range(3):
        engine.add_request(tokens(40, seed=30 + i), SamplingParams(max_tokens=4, **GREEDY))
    engine.step()  # one request admitted with a 16-token chunk, two waiting
    s = engine.stats()
    assert (s.waiting, s.running, s.running_decodes) == (2, 1, 0)
    assert s.queued_prefill_tokens == 40 - 16 + 2 * 40
    while engine.stats().running_decodes == 0:
        engine.step()
    assert engine.stats().running_decodes == 1
