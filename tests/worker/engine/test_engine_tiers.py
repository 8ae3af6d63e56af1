"""Requests served through prefixes loaded from the host tier (docs/design.md §9.9) compute
exactly what a cold run computes: greedy tokens equal transformers', logits within 1e-4 of a
cold run, for every architecture, with chunked prefill, batches and page sizes 1/4/16; the
outputs and stats report what was loaded; random mixes with offload, load, repair, retention,
eviction at both tiers, aborts and retraction keep every invariant after every step."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from tests.worker.engine.test_engine_properties import Mix, repair_mixes
from tests.worker.engine.test_engine_repair import assert_like_cold, run, tapped
from tests.worker.models.hf_tiny import ARCHS, TinyHF
from worker.engine.engine import Engine
from worker.models.spec import LayerKind

GREEDY = dict(temperature=0.0, ignore_eos=True)
# A CPU prefill of these tiny models is far cheaper than the default H200 figure says: price
# compute high so that every host-resident prefix is loaded, never recomputed.
TIER = dict(host_kv_bytes=16 << 20, prefill_tflops=1e-9)


def offload_all(engine: Engine, full: bool) -> None:
    """Device eviction of every unlocked page (full: the full KV too, else SWA only): with a
    tier it all moves to the host."""
    c = engine.cache
    c.evict(c.full_evictable if full else 0, c.swa_evictable)


@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_loaded_from_host_matches_transformers_and_a_cold_run(
    tiny: dict[str, TinyHF], arch: str, page: int
) -> None:
    """B loads a prefix whose full and SWA KV went to the host (batched with a cold request,
    chunked), then C loads the window's SWA of a prefix whose SWA alone went there: tokens equal
    transformers', logits equal a cold run's."""
    hf = tiny[arch]
    engine, tap = tapped(hf.path, page, **TIER)
    shared = tokens(48 + 3 * page, seed=31)
    run(engine, [shared + tokens(5, seed=32)])
    offload_all(engine, full=True)
    b, other, c = shared + tokens(9, seed=33), tokens(3 * page + 5, seed=34), shared + [5]
    rid_b, rid_other = run(engine, [b, other])
    loaded = engine.stats()
    assert loaded.loaded_full_tokens >= len(shared) - page and loaded.loaded_swa_tokens > 0
    offload_all(engine, full=False)
    (rid_c,) = run(engine, [c])
    after = engine.stats()
    assert after.loaded_swa_tokens > loaded.loaded_swa_tokens, "C loads its window's SWA"
    assert_like_cold(hf, page, tap, [(rid_b, b), (rid_other, other)], [(rid_c, c)])
    assert_all_free(engine)
    s = engine.stats()
    assert s.host_full.used == s.host_swa.used == 0, "a flush empties the host tier too"


def test_outputs_and_stats_report_loaded_tokens(oracle: Oracle) -> None:
    """`cached_tokens` counts the skipped forward (loaded included), `loaded_tokens` what came
    from the host; the stats count tokens, bytes per kind, offloads and the tier's use."""
    engine = oracle.engine(**TIER)
    first = tokens(120, seed=41)
    engine.generate([first], SamplingParams(max_tokens=4, **GREEDY))
    offload_all(engine, full=True)
    engine.step()  # idle: publishes the stats (and runs the queued copies)
    s = engine.stats()
    assert s.offloaded_tokens >= 120 and s.host_full.used >= 120 and s.host_swa.used > 0
    second = first[:100] + tokens(9, seed=42)
    out = engine.generate([second], SamplingParams(max_tokens=6, **GREEDY))[0]
    s = engine.stats()
    host = engine.parts.host
    assert host is not None and s.loaded_tokens == 100 and s.loaded_full_tokens == 100
    # The request counts full and SWA KV apart (what the router predicts: Reuse's two parts).
    assert (out.cached_tokens, out.loaded_tokens) == (100, 100 + s.loaded_swa_tokens)
    assert out.token_ids == oracle.greedy(second, 6)
    want = 100 * host.bytes_per_token(LayerKind.FULL) + s.loaded_swa_tokens * host.bytes_per_token(LayerKind.SWA)
    assert s.loaded_bytes == int(want) and engine.tier_costs is not None
    assert_all_free(engine)


def test_without_a_tier_nothing_moves(oracle: Oracle) -> None:
    """host_kv_bytes 0 (the CPU default): no tier, no costs, nothing offloaded or loaded."""
    engine = oracle.engine()
    assert engine.parts.host is None and engine.tier_costs is None
    engine.generate([tokens(60, seed=43)], SamplingParams(max_tokens=2, **GREEDY))
    offload_all(engine, full=True)
    s = engine.stats()
    assert (s.offloaded_tokens, s.loaded_tokens, s.host_full.total) == (0, 0, 0)


@pytest.mark.usefixtures("overlap")
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    mix=repair_mixes(),
    host_kv_bytes=st.sampled_from([48 << 10, 256 << 10, 4 << 20]),
    prefill_tflops=st.sampled_from([1e-9, 1e-4, 400.0]),  # load always / mixed / never pays
    evict_every=st.sampled_from([2, 5, 1000]),
    host_evict=st.sampled_from([(0, 0), (8, 8), (64, 32)]),
)
def test_random_mixes_with_a_host_tier_keep_invariants_and_parity(
    oracle: Oracle, mix: Mix, host_kv_bytes: int, prefill_tflops: float, evict_every: int,
    host_evict: tuple[int, int],
) -> None:  # fmt: skip
    """Requests arrive one after another over small device pools and a small host tier; every
    few steps the tree is evicted at both tiers (device full and SWA → host, host → gone):
    offloads, loads, repairs, retention, aborts and retraction mix; invariants after every
    step, greedy parity, both tiers free after a flush."""
    config = dict(mix.config, host_kv_bytes=host_kv_bytes, prefill_tflops=prefill_tflops,
                  host_swa_full_tokens_ratio=0.5)  # fmt: skip
    engine = oracle.engine(**config)
    host = engine.parts.host
    assert host is not None
    got: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    def sink(d: StreamDelta) -> None:
        got.setdefault(d.request_id, []).extend(d.token_ids)
        reasons[d.request_id] = d.finish_reason

    rids: list[str] = []

    def on_step(step: int) -> None:
        if step % 3 == 0 and len(rids) < len(mix.prompts):
            i = len(rids)
            params = SamplingParams(max_tokens=mix.max_tokens[i], **GREEDY)
            rids.append(engine.add_request(mix.prompts[i], params, on_delta=sink))
        if step % evict_every == evict_every - 1:
            c = engine.cache
            c.evict(c.full_evictable // 2, c.swa_evictable)
            host.tier.evict(c.tree, *host_evict)
        for rid, at in zip(rids, mix.abort_at):
            if at == step:
                engine.abort(rid)

    on_step(0)
    run_checked(engine, on_step, limit=4000)
    while len(rids) < len(mix.prompts):
        on_step(3 * len(rids))
        run_checked(engine, on_step, limit=4000)
    for i, (rid, prompt, m) in enumerate(zip(rids, mix.prompts, mix.max_tokens)):
        want = oracle.greedy(prompt, m)
        if reasons[rid] == "abort":
            assert got[rid] == want[: len(got[rid])], f"request {i} before its abort"
        else:
            assert (got[rid], reasons[rid]) == (want, "length"), f"request {i}"
    assert_all_free(engine)
    s = engine.stats()
    assert s.host_full.used == s.host_swa.used == 0
