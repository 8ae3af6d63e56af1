"""Requests served through a tombstone repair compute exactly what a cold run computes
(docs/design.md §9.8): greedy tokens equal transformers', logits within 1e-4 of a cold run of
the same prompt, for every architecture, with chunked prefill, batches and page sizes 1/4/16."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from core.geometry import Geometry
from core.reuse import plan_reuse, repair_rows
from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from tests.worker.models.hf_tiny import ARCHS, TinyHF, hf_greedy
from worker.config import EngineConfig
from worker.engine.engine import Engine
from worker.runner.forward_batch import ForwardBatch, ForwardOutput

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_NEW = 8
ATOL = 1e-4
CHUNK = {1: 7, 4: 512, 16: 24}  # multi-chunk repairs at P=1 and 16, one forward at P=4


class LogitTap:
    """The engine's runner, recording each request's sampled logits rows (test only)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.inner = engine, engine.runner
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.repair_rows = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        out = self.inner.forward(batch)
        by_table = {id(r.kv.table): rid for rid, r in self.engine.scheduler.reqs.items() if r.kv}
        wanted = [r for r in batch.reqs if r.need_logits]
        for row, fr in zip(out.logits, wanted):
            self.rows[by_table[id(fr.table)]].append(row.clone())
        self.repair_rows += sum(r.repair_tokens for r in batch.reqs)
        return out

    def sample(self, logits, params, generators):  # noqa: ANN001, ANN201 - delegation
        return self.inner.sample(logits, params, generators)


def tapped(path: Path, page: int, **over: object) -> tuple[Engine, LogitTap]:
    cfg = dict(model=str(path), page_size=page, max_total_tokens=4096, swa_full_tokens_ratio=0.5,
               chunked_prefill_size=CHUNK[page], swa_eviction_interval=4)  # fmt: skip
    cfg.update(over)
    engine = Engine(EngineConfig(**cfg))  # type: ignore[arg-type]
    tap = LogitTap(engine)
    engine.runner = tap  # type: ignore[assignment]
    return engine, tap


def run(engine: Engine, prompts: Sequence[list[int]]) -> list[str]:
    rids = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, **GREEDY)) for p in prompts]
    run_checked(engine)
    return rids


def assert_like_cold(
    hf: TinyHF, page: int, tap: LogitTap, *batches: list[tuple[str, list[int]]]
) -> Engine:
    """Run each batch of (request id, prompt) again on a cold engine, in the same batches: every
    request's greedy tokens equal transformers', its logits within ATOL of the cold run's.
    Returns the cold engine (its cache holds what the batches left)."""
    cold, cold_tap = tapped(hf.path, page, tombstone_repair="off")
    for batch in batches:
        for (rid, prompt), cold_rid in zip(batch, run(cold, [p for _, p in batch])):
            ours, ref = torch.stack(tap.rows[rid]), torch.stack(cold_tap.rows[cold_rid])
            assert [int(x) for x in ours.argmax(-1)] == hf_greedy(hf.model, prompt, MAX_NEW)[0]
            diff = (ours - ref).abs().max().item()
            assert diff < ATOL, f"P={page}: logits differ from a cold run by {diff:.2e}"
    return cold


def swa_kv(engine: Engine, prefix: list[int], lo: int) -> list[torch.Tensor]:
    """Per SWA layer, the cached K and V of positions [lo, len(prefix)) (the tree's slots)."""
    full = engine.cache.match_full(prefix).indices[lo:]
    swa = engine.allocator.translate(full)
    assert bool((swa > 0).all()), "those pages have no SWA KV"
    pool = engine.runner.inner.pool  # type: ignore[attr-defined]
    return [buf[swa] for lid in engine.spec.swa_layer_ids for buf in pool.kv_buffers(lid)]


@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_repaired_prefix_matches_transformers_and_a_cold_run(
    tiny: dict[str, TinyHF], arch: str, page: int
) -> None:
    """B repairs a fully tombstoned prefix (batched with a cold request, chunked), then C
    reuses the revived prefix and queries right after it, so every SWA layer reads the revived
    tail: tokens equal transformers', logits and the revived KV equal a cold run's."""
    hf = tiny[arch]
    engine, tap = tapped(hf.path, page)
    spec = engine.spec
    assert spec.window is not None
    n_swa = len(spec.swa_layer_ids)
    rows = repair_rows(Geometry(page, spec.window, n_swa))
    shared = tokens(4 * rows + 2 * page, seed=11)
    run(engine, [shared + tokens(5, seed=12)])
    engine.cache.evict(0, engine.cache.swa_evictable)  # every SWA page goes; full KV stays
    b, other, c = shared + tokens(9, seed=13), tokens(3 * page + 5, seed=14), shared + [5]
    m = engine.cache.match_prefix(b[:-1])
    want = plan_reuse(m.full_length, m.length, Geometry(page, spec.window, n_swa), repair=True)
    assert want.repaired == rows > 0 and want.reused + rows == len(shared)
    rid_b, rid_other = run(engine, [b, other])
    stats = engine.stats()
    assert stats.repairs == 1 and stats.repaired_tokens == rows and tap.repair_rows == rows
    (rid_c,) = run(engine, [c])
    assert engine.stats().repairs == 1, "C reuses the revived prefix as it is"
    cold = assert_like_cold(hf, page, tap, [(rid_b, b), (rid_other, other)], [(rid_c, c)])
    tail = len(shared) - max(page, -(-spec.window // page) * page)
    for got, ref in zip(swa_kv(engine, shared, tail), swa_kv(cold, shared, tail)):
        assert (got - ref).abs().max().item() < ATOL, "a revived SWA page is not exact"
    assert_all_free(engine)


def test_repair_outputs_report_cached_and_repaired_tokens(oracle: Oracle) -> None:
    """`cached_tokens` = tokens whose forward was skipped (p_full − R), `repaired_tokens` = R,
    exactly what the shared rule predicts; the next request then finds the prefix valid."""
    engine = oracle.engine(chunked_prefill_size=32)
    first = tokens(200, seed=21)
    engine.generate([first], SamplingParams(max_tokens=4, **GREEDY))
    engine.cache.evict(0, engine.cache.swa_evictable)
    second = first[:160] + tokens(7, seed=22)
    m = engine.cache.match_prefix(second[:-1])
    spec = engine.spec
    want = plan_reuse(m.full_length, m.length, Geometry(4, spec.window, len(spec.swa_layer_ids)), repair=True)
    out = engine.generate([second], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert (out.cached_tokens, out.repaired_tokens) == (want.reused, want.repaired)
    assert want.repaired > 0 and out.token_ids == oracle.greedy(second, 8)
    again = engine.generate([second[:-1] + [3]], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert (again.cached_tokens, again.repaired_tokens) == (164, 0)  # floor_P(166)
    off = oracle.engine(chunked_prefill_size=32, tombstone_repair="off")
    off.generate([first], SamplingParams(max_tokens=4, **GREEDY))
    off.cache.evict(0, off.cache.swa_evictable)
    out = off.generate([second], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert (out.cached_tokens, out.repaired_tokens) == (0, 0)
    assert_all_free(engine)
