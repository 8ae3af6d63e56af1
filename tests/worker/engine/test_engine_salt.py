"""Cache salts through the engine (docs/design.md §9.10): the same prompt under another salt (or
none) reuses nothing and reports no cached tokens, under the same salt it reuses the whole
prompt, the tokens equal the oracle's either way, and the published pages are named by each
salt's own chain."""

from __future__ import annotations

import pytest

from core.events import page_hashes, salted_root
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, tokens

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _run(engine, prompt: list[int], salt: str | None, oracle: Oracle) -> int:
    out = engine.generate([prompt], SamplingParams(max_tokens=6, cache_salt=salt, **GREEDY))[0]
    assert out.token_ids == oracle.greedy(prompt, 6)
    engine.check_integrity()
    return out.cached_tokens


def test_two_salts_with_the_same_prompt_share_nothing(oracle: Oracle) -> None:
    """Tenant A's prompt is cached for A only: B and unsalted requests recompute it."""
    engine = oracle.engine(chunked_prefill_size=256)
    system = tokens(96, seed=31)
    assert _run(engine, system + tokens(8, seed=32), "tenant-a", oracle) == 0
    assert _run(engine, system + tokens(8, seed=33), "tenant-b", oracle) == 0
    assert _run(engine, system + tokens(8, seed=34), None, oracle) == 0
    assert _run(engine, system + tokens(8, seed=35), "tenant-a", oracle) == 96
    assert _run(engine, system + tokens(8, seed=36), "tenant-b", oracle) == 96
    pages = engine.cache_snapshot()
    for salt in ("tenant-a", "tenant-b", None):
        assert all(h in pages for h in page_hashes(system, 4, salted_root(salt)))
    assert engine.flush_cache()
    s = engine.stats()
    assert (s.full.free, s.swa.free) == (s.full.total, s.swa.total)


def test_an_empty_salt_is_refused() -> None:
    """"" is no salt at all (it would look like one to the client): refused by name."""
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="").validate()


def test_the_salt_stays_out_of_the_repr() -> None:
    """A salt is a tenant's secret: params printed in a log do not show it."""
    assert "secret-salt" not in repr(SamplingParams(cache_salt="secret-salt"))
