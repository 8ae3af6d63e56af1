"""The torch backend's padded groups: a batch attended together equals each request alone."""

from __future__ import annotations

import pytest
import torch

from tests.worker.attention.conftest import FakePool
from worker.attention.base import AttentionLayer, AttnBatch, KVView
from worker.attention.torch_backend import TorchBackend
from worker.models.spec import LayerKind

HQ, HKV, D, DV = 6, 3, 8, 5




def _batch(q_lens, prefixes, window, tables) -> AttnBatch:
    starts = [max(0, p - window) if window is not None else 0 for p in prefixes]
    parts = [t[s : p + q] for t, s, p, q in zip(tables, starts, prefixes, q_lens)]
    indptr = torch.cumsum(torch.tensor([0] + [len(x) for x in parts]), 0)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefixes, q_lens)])
    seq = tuple(p + q for p, q in zip(prefixes, q_lens))
    kind = LayerKind.FULL if window is None else LayerKind.SWA
    return AttnBatch(tuple(q_lens), seq, positions, {kind: KVView(torch.cat(parts), indptr, tuple(starts))}, window)  # fmt: skip


@pytest.mark.parametrize("window,with_sinks", [(None, False), (4, True)])
def test_batched_groups_equal_requests_alone(
    window: int | None, with_sinks: bool, kernel: bool
) -> None:
    """Decodes and prefill chunks of very different shapes (several groups) vs one at a time."""
    gen = torch.Generator().manual_seed(3)
    slots = 400
    pool = FakePool(
        torch.randn(slots, HKV, D, generator=gen), torch.randn(slots, HKV, DV, generator=gen)
    )
    q_lens = [1, 40, 2, 1, 3, 17, 1, 2]
    prefixes = [30, 0, 5, 3, 50, 9, 0, 1]
    perm = (torch.randperm(slots - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for q, p in zip(q_lens, prefixes):
        tables.append(torch.tensor(perm[used : used + p + q]))
        used += p + q
    kind = LayerKind.FULL if window is None else LayerKind.SWA
    layer = AttentionLayer(0, kind, HQ, HKV, D, DV, scaling=D**-0.5)
    sinks = torch.randn(HQ, generator=gen) if with_sinks else None
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    backend = TorchBackend(pool, kernel)  # type: ignore[arg-type]
    meta = backend.plan(_batch(q_lens, prefixes, window, tables))
    if not kernel:
        assert len(meta.per_kind[kind]) >= 3  # decodes + at least two prefill shapes
    got = backend.forward(layer, q, meta, sinks)
    row = 0
    for i, (ql, p) in enumerate(zip(q_lens, prefixes)):
        alone = backend.plan(_batch([ql], [p], window, [tables[i]]))
        want = backend.forward(layer, q[row : row + ql], alone, sinks)
        torch.testing.assert_close(got[row : row + ql], want, atol=1e-6, rtol=1e-5)
        row += ql


def test_paged_view_equals_the_flat_view(kernel: bool) -> None:
    """The FULL keys read from a page table (rows out of order, longer than the requests, junk
    past each request's end) give the flat view's output, and `flat_indices` rebuilds its
    indices exactly."""
    gen = torch.Generator().manual_seed(5)
    slots = 300
    pool = FakePool(torch.randn(slots, HKV, D, generator=gen), torch.randn(slots, HKV, DV, generator=gen))
    q_lens, prefixes = [1, 12, 1, 5, 1], [20, 0, 7, 30, 0]
    perm = (torch.randperm(slots - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for q, p in zip(q_lens, prefixes):
        tables.append(torch.tensor(perm[used : used + p + q]))
        used += p + q
    flat = _batch(q_lens, prefixes, None, tables)
    rows = (3, 0, 6, 1, 4)  # each request's row of a 7-row table
    table = torch.randint(1, slots, (7, 64), generator=gen, dtype=torch.int32)
    for r, t in zip(rows, tables):
        table[r, : len(t)] = t.int()
    view = KVView.paged(table, rows, torch.tensor(rows), (0,) * 5, flat.seq_lens)
    paged = AttnBatch(flat.q_lens, flat.seq_lens, flat.positions, {LayerKind.FULL: view}, None)
    assert torch.equal(view.flat_indices(), flat.kv[LayerKind.FULL].flat_indices())
    layer = AttentionLayer(0, LayerKind.FULL, HQ, HKV, D, DV, scaling=D**-0.5)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    backend = TorchBackend(pool, kernel)  # type: ignore[arg-type]
    got = backend.forward(layer, q, backend.plan(paged))
    want = backend.forward(layer, q, backend.plan(flat))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
