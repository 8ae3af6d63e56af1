"""Property test: random request mixes (lengths, shared prefixes, max_tokens, aborts) against
small pools keep every invariant after every step and exact greedy parity for every request
that was not aborted; the pools end fully free."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.outputs import StreamDelta
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens

pytestmark = pytest.mark.usefixtures("overlap")  # every test with overlap off and on

GREEDY = dict(temperature=0.0, ignore_eos=True)
PREFIXES = (tokens(48, seed=600), tokens(48, seed=601))


@dataclass(frozen=True)
class Mix:
    config: dict
    prompts: list[list[int]]
    max_tokens: list[int]
    abort_at: list[int | None]  # step after which the request is aborted


@st.composite
def mixes(draw: st.DrawFn) -> Mix:
    config = dict(
        page_size=draw(st.sampled_from([1, 4, 8])),
        enable_radix_cache=draw(st.booleans()),
        eager_swa_free=draw(st.booleans()),
        max_total_tokens=draw(st.sampled_from([256, 512])),
        chunked_prefill_size=draw(st.sampled_from([8, 16, 32])),
        swa_eviction_interval=draw(st.sampled_from([1, 4, 16])),
        max_running_requests=draw(st.integers(1, 6)),
    )
    # NOTE: SWA pools of 2W (32 here) and below can stall a lone request in radix mode (its
    # window lock covers whole nodes, up to ~2W, leaving no room to decode); 40 is the smallest
    # size that random mixes never stalled.
    swa_tokens = draw(st.sampled_from([40, 48, 64, 96]))
    config["swa_full_tokens_ratio"] = swa_tokens / config["max_total_tokens"]
    n = draw(st.integers(1, 6))
    prompts, max_tokens, abort_at = [], [], []
    for _ in range(n):
        which = draw(st.sampled_from([None, 0, 1]))
        prefix = [] if which is None else PREFIXES[which][: draw(st.integers(1, 48))]
        prompts.append(prefix + tokens(draw(st.integers(1, 24)), seed=draw(st.integers(0, 10_000))))
        max_tokens.append(draw(st.integers(1, 16)))
        abort_at.append(draw(st.one_of(st.none(), st.integers(0, 30))))
    return Mix(config, prompts, max_tokens, abort_at)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mix=mixes())
def test_random_mixes_keep_invariants_and_parity(oracle: Oracle, mix: Mix) -> None:
    """Invariants after every step, greedy parity (or a parity prefix before an abort), free pools."""
    engine = oracle.engine(**mix.config)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}

    def sink(d: StreamDelta) -> None:
        got.setdefault(d.request_id, []).extend(d.token_ids)
        reasons[d.request_id] = d.finish_reason

    rids = [engine.add_request(p, SamplingParams(max_tokens=m, **GREEDY), on_delta=sink)
            for p, m in zip(mix.prompts, mix.max_tokens)]  # fmt: skip

    def on_step(step: int) -> None:
        for rid, at in zip(rids, mix.abort_at):
            if at == step:
                engine.abort(rid)

    run_checked(engine, on_step, limit=3000)
    for i, (rid, prompt, m) in enumerate(zip(rids, mix.prompts, mix.max_tokens)):
        want = oracle.greedy(prompt, m)
        if reasons[rid] == "abort":
            assert mix.abort_at[i] is not None
            assert got[rid] == want[: len(got[rid])], f"request {i} before its abort"
        else:
            assert (got[rid], reasons[rid]) == (want, "length"), f"request {i}"
    assert_all_free(engine)


LONG_PREFIXES = (tokens(160, seed=610), tokens(160, seed=611))


@st.composite
def repair_mixes(draw: st.DrawFn) -> Mix:
    """Long shared prefixes, SWA pools far below them, both policies: tombstoned prefixes
    come back through repairs while others evict, abort and retract."""
    config = dict(
        page_size=draw(st.sampled_from([1, 4, 8])),
        max_total_tokens=draw(st.sampled_from([384, 512, 768])),
        chunked_prefill_size=draw(st.sampled_from([16, 48, 256])),
        swa_eviction_interval=draw(st.sampled_from([1, 8])),
        max_running_requests=draw(st.integers(1, 6)),
        swa_eviction_policy=draw(st.sampled_from(["tail_first", "lru"])),
        tombstone_repair=draw(st.sampled_from(["auto", "auto", "off"])),
    )
    swa = draw(st.sampled_from([56, 96, 192]))
    config["swa_full_tokens_ratio"] = swa / config["max_total_tokens"]
    prompts, max_tokens, abort_at = [], [], []
    for _ in range(draw(st.integers(2, 6))):
        prefix = LONG_PREFIXES[draw(st.integers(0, 1))][: draw(st.integers(64, 160))]
        prompts.append(prefix + tokens(draw(st.integers(1, 24)), seed=draw(st.integers(0, 10_000))))
        max_tokens.append(draw(st.integers(1, 40)))
        abort_at.append(draw(st.one_of(st.none(), st.none(), st.integers(0, 60))))
    return Mix(config, prompts, max_tokens, abort_at)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mix=repair_mixes(), evict_every=st.sampled_from([2, 5, 1000]))
def test_random_mixes_with_repairs_keep_invariants_and_parity(
    oracle: Oracle, mix: Mix, evict_every: int
) -> None:
    """Requests arrive one after another (so later ones find earlier prefixes), SWA is evicted
    from the tree every few steps: repairs, retention, eviction, aborts and retraction mix;
    invariants after every step, greedy parity, free pools after a flush."""
    engine = oracle.engine(**mix.config)
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
            engine.cache.evict(0, engine.cache.swa_evictable)
        for rid, at in zip(rids, mix.abort_at):
            if at == step:
                engine.abort(rid)

    on_step(0)
    run_checked(engine, on_step, limit=4000)
    while len(rids) < len(mix.prompts):  # the engine went idle before every request arrived
        on_step(3 * len(rids))
        run_checked(engine, on_step, limit=4000)
    for i, (rid, prompt, m) in enumerate(zip(rids, mix.prompts, mix.max_tokens)):
        want = oracle.greedy(prompt, m)
        if reasons[rid] == "abort":
            assert got[rid] == want[: len(got[rid])], f"request {i} before its abort"
        else:
            assert (got[rid], reasons[rid]) == (want, "length"), f"request {i}"
    assert_all_free(engine)
