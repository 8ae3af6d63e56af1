"""Decode out of room: the scheduler retracts, outputs stay exact, nothing leaks; and the
small-pool corner cases that used to retract needlessly or stall the queue."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import WINDOW, Oracle, assert_all_free, run_checked, tokens
from worker.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("overlap")  # every test with overlap off and on

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _run(
    engine: Engine,
    prompts: list[list[int]],
    max_tokens: int,
    params: list[SamplingParams] | None = None,
) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    params = params or [SamplingParams(max_tokens=max_tokens, **GREEDY)] * len(prompts)
    rids = [
        engine.add_request(
            p, sp, on_delta=lambda d: got.setdefault(d.request_id, []).extend(d.token_ids)
        )
        for p, sp in zip(prompts, params)
    ]
    run_checked(engine)
    return {rid: got[rid] for rid in rids}


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "chunk_cache"])
def test_decode_out_of_room_retracts_and_stays_exact(oracle: Oracle, radix: bool) -> None:
    """Short prompts are all admitted at once; their windows then outgrow a 48-token SWA pool."""
    engine = oracle.engine(max_total_tokens=256, swa_full_tokens_ratio=48 / 256, chunked_prefill_size=64,
                           swa_eviction_interval=4, enable_radix_cache=radix)  # fmt: skip
    prompts = [tokens(5 + i, seed=70 + i) for i in range(8)]
    got = _run(engine, prompts, 24)
    assert engine.stats().retractions > 0
    for i, (out, prompt) in enumerate(zip(got.values(), prompts)):
        assert out == oracle.greedy(prompt, 24), f"request {i}"
    assert_all_free(engine)


def test_seeded_sampling_is_unchanged_by_retraction(oracle: Oracle) -> None:
    """A retracted request re-prefills but draws no extra noise: seeded samples equal a run alone."""
    engine = oracle.engine(max_total_tokens=256, swa_full_tokens_ratio=48 / 256, chunked_prefill_size=64,
                           swa_eviction_interval=4)  # fmt: skip
    prompts = [tokens(5 + i, seed=70 + i) for i in range(8)]
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    got = _run(engine, prompts, 24, params)
    assert engine.stats().retractions > 0
    alone = oracle.engine()
    for i, (out, prompt, sp) in enumerate(zip(got.values(), prompts, params)):
        assert out == alone.generate([prompt], sp)[0].token_ids, f"request {i}"
    assert_all_free(engine)


def test_retraction_with_locked_shared_prefixes(oracle: Oracle) -> None:
    """Retracted requests that locked a shared prefix give it back and re-find it on re-admission."""
    engine = oracle.engine(max_total_tokens=256, swa_full_tokens_ratio=64 / 256, chunked_prefill_size=64,
                           swa_eviction_interval=4)  # fmt: skip
    shared = tokens(8, seed=80)
    engine.generate([shared + [1]], SamplingParams(max_tokens=1, **GREEDY))
    prompts = [shared + tokens(2 + i, seed=81 + i) for i in range(8)]
    got = _run(engine, prompts, 24)
    s = engine.stats()
    assert s.retractions > 0 and s.cache_hit_tokens > 0
    for i, (out, prompt) in enumerate(zip(got.values(), prompts)):
        assert out == oracle.greedy(prompt, 24), f"request {i}"
    assert_all_free(engine)


def test_a_lone_request_is_not_retracted_for_its_own_eviction_interval(oracle: Oracle) -> None:
    """W + interval + P exceeds the SWA pool: before retracting, the scheduler frees what already
    left the window, so a request alone decodes without ever being retracted."""
    engine = oracle.engine(
        max_total_tokens=256, swa_full_tokens_ratio=48 / 256, swa_eviction_interval=128
    )
    prompt = tokens(20, seed=90)
    got = _run(engine, [prompt], 60)
    assert list(got.values()) == [oracle.greedy(prompt, 60)]
    assert engine.stats().retractions == 0
    assert engine.stats().swa.peak_used <= 48
    assert_all_free(engine)


def test_window_lock_is_released_once_the_prefix_leaves_the_window(oracle: Oracle) -> None:
    """The query at position protected + W reads keys from `protected` on: the prefix's SWA lock
    is gone before that query runs (not one token later)."""
    engine = oracle.engine(
        max_total_tokens=512, swa_full_tokens_ratio=0.25, swa_eviction_interval=4
    )
    shared = tokens(32, seed=91)
    engine.generate([shared + [1]], SamplingParams(max_tokens=1, **GREEDY))
    prompt = shared + tokens(2, seed=92)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2 * WINDOW, **GREEDY))
    checked = []

    def on_step(_: int) -> None:
        req = next((r for r in engine.scheduler.running if r.rid == rid), None)
        if req is None or req.kv is None:
            return
        kv = req.kv
        assert kv.cache_protected_len == 32  # the match; the 2-token tail is below a page
        if kv.kv_committed_len > kv.cache_protected_len + WINDOW:  # that query has run
            assert kv.swa_lock_released, f"lock still held at committed {kv.kv_committed_len}"
            checked.append(kv.kv_committed_len)

    run_checked(engine, on_step)
    assert checked and checked[0] == 32 + WINDOW + 1
    assert_all_free(engine)


def test_a_prefix_lock_filling_the_swa_pool_does_not_stall_the_queue(oracle: Oracle) -> None:
    """Locks cover whole nodes: a match ending in a 12-token node also locks the 16-token node
    above it, leaving 20 of 48 SWA slots, less than the admission charge W + P + chunk. Alone
    (nothing will ever free more), the request must still be admitted."""
    engine = oracle.engine(max_total_tokens=256, swa_full_tokens_ratio=48 / 256, chunked_prefill_size=16,
                           swa_eviction_interval=128)  # fmt: skip
    first = tokens(30, seed=93)
    engine.generate([first], SamplingParams(max_tokens=1, **GREEDY))  # live nodes [0, 16), [16, 28)
    second = first[:28] + tokens(3, seed=94)
    got = _run(engine, [second], 24)
    assert list(got.values()) == [oracle.greedy(second, 24)]
    assert engine.stats().cache_hit_tokens == 28
    assert_all_free(engine)


def test_a_chunk_starting_mid_page_is_not_deferred_forever(oracle: Oracle) -> None:
    """The first request leaves one token of the step's prefill budget, so the second one's
    later chunks start mid-page. The room asked for such a chunk must be the fresh pages it
    takes, not two pages more: alone in a 64-token SWA pool it would otherwise never run."""
    engine = oracle.engine(page_size=8, max_total_tokens=256, swa_full_tokens_ratio=64 / 256,
                           chunked_prefill_size=32, swa_eviction_interval=4, eager_swa_free=True)  # fmt: skip
    prompts = [tokens(31, seed=95), tokens(61, seed=96)]
    got = _run(engine, prompts, 0, [SamplingParams(max_tokens=m, **GREEDY) for m in (16, 12)])
    assert list(got.values()) == [oracle.greedy(prompts[0], 16), oracle.greedy(prompts[1], 12)]
    assert_all_free(engine)


def test_a_request_the_pools_can_never_step_is_refused_not_hung(oracle: Oracle) -> None:
    """An SWA pool barely above W + P: whole-node window locks leave a lone radix request no
    room for its last tokens. The engine refuses it with a clear error instead of spinning."""
    engine = oracle.engine(page_size=4, max_total_tokens=256, swa_full_tokens_ratio=32 / 256,
                           chunked_prefill_size=16)  # fmt: skip
    out = engine.generate([tokens(30, seed=77)], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.finish_reason == "abort" and "SWA pool 32 tokens" in (out.error or ""), out
    engine.check_integrity()
    assert engine.flush_cache()
    s = engine.stats()
    assert (s.full.free, s.swa.free) == (s.full.total, s.swa.total)
