"""The torch reference backend against a per-query loop written from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.attention.conftest import FakePool
from worker.attention.base import AttentionLayer, AttnBatch, KVView, check_views
from worker.attention.torch_backend import TorchBackend
from worker.models.spec import LayerKind

HQ, HKV, D, DV = 4, 2, 8, 6




def _layer(kind: LayerKind, softcap: float | None = None) -> AttentionLayer:
    return AttentionLayer(0, kind, HQ, HKV, D, DV, scaling=D**-0.5, softcap=softcap)


def _batch(
    q_lens: list[int],
    prefix_lens: list[int],
    kind: LayerKind,
    window: int | None,
    slots: int,
    gen: torch.Generator,
):
    """Random distinct slots per request; the view starts where the window rule says."""
    perm = torch.randperm(slots - 1, generator=gen) + 1  # slot 0 is the dummy
    tables, used = [], 0
    for q, p in zip(q_lens, prefix_lens):
        tables.append(perm[used : used + p + q])
        used += p + q
    starts = [0 if kind is LayerKind.FULL else max(0, p - window) for p in prefix_lens]
    parts = [t[s:] for t, s in zip(tables, starts)]
    indptr = torch.cumsum(torch.tensor([0] + [len(x) for x in parts]), 0)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix_lens, q_lens)])
    seq_lens = tuple(p + q for p, q in zip(prefix_lens, q_lens))
    view = KVView(torch.cat(parts), indptr, tuple(starts))
    return AttnBatch(tuple(q_lens), seq_lens, positions, {kind: view}, window), tables


def _naive(q, pool, tables, batch, window, scaling, softcap, sinks):
    out = torch.zeros(q.shape[0], HQ, DV, dtype=torch.float64)
    row = 0
    for table, seq, q_len in zip(tables, batch.seq_lens, batch.q_lens):
        for j in range(q_len):
            pos = seq - q_len + j
            keys = [k for k in range(seq) if k <= pos and (window is None or k >= pos - window)]
            for h in range(HQ):
                kv_h = h // (HQ // HKV)
                s = [
                    float(q[row, h].double() @ pool.k[table[k], kv_h].double()) * scaling
                    for k in keys
                ]
                if softcap is not None:
                    s = [math.tanh(x / softcap) * softcap for x in s]
                denom = sum(math.exp(x) for x in s) + (
                    math.exp(float(sinks[h])) if sinks is not None else 0.0
                )
                for k, x in zip(keys, s):
                    out[row, h] += math.exp(x) / denom * pool.v[table[k], kv_h].double()
            row += 1
    return out


CASES = [
    (LayerKind.FULL, None, None, False),
    (LayerKind.SWA, 3, None, False),
    (LayerKind.SWA, 3, None, True),
    (LayerKind.SWA, 5, 2.0, True),
    (LayerKind.FULL, None, 2.0, True),
]


@pytest.mark.parametrize("kind,window,softcap,with_sinks", CASES)
def test_matches_definition_on_mixed_batch(kind, window, softcap, with_sinks, kernel) -> None:
    """Decodes and prefill chunks (with and without a prefix) in one batch, GQA, Dv != D."""
    gen = torch.Generator().manual_seed(0)
    slots = 128
    pool = FakePool(
        torch.randn(slots, HKV, D, generator=gen), torch.randn(slots, HKV, DV, generator=gen)
    )
    q_lens, prefix = [1, 5, 1, 7, 3], [9, 0, 2, 6, 12]
    batch, tables = _batch(q_lens, prefix, kind, window, slots, gen)
    check_views(batch)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    sinks = torch.randn(HQ, generator=gen) if with_sinks else None
    layer = _layer(kind, softcap)
    backend = TorchBackend(pool, kernel)  # type: ignore[arg-type]
    got = backend.forward(layer, q, backend.plan(batch), sinks)
    want = _naive(
        q,
        pool,
        tables,
        batch,
        window if kind is LayerKind.SWA else None,
        layer.scaling,
        softcap,
        sinks,
    )
    assert got.shape == (sum(q_lens), HQ, DV)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_window_edge_is_inclusive(kernel: bool) -> None:
    """A query at q sees the key at q - window and not the one at q - window - 1."""
    gen = torch.Generator().manual_seed(1)
    window, prefix = 4, 10
    pool = FakePool(torch.randn(64, HKV, D, generator=gen), torch.randn(64, HKV, DV, generator=gen))
    batch, tables = _batch([1], [prefix], LayerKind.FULL, None, 64, gen)
    # Same request seen as SWA: its view is the last window + 1 positions of the table.
    swa_view = KVView(
        tables[0][prefix - window :], torch.tensor([0, window + 1]), (prefix - window,)
    )
    swa = AttnBatch(
        batch.q_lens, batch.seq_lens, batch.positions, {LayerKind.SWA: swa_view}, window
    )
    q = torch.randn(1, HQ, D, generator=gen)
    backend = TorchBackend(pool, kernel)  # type: ignore[arg-type]

    def run() -> torch.Tensor:
        return backend.forward(_layer(LayerKind.SWA), q, backend.plan(swa))

    base = run()
    pool.v[tables[0][prefix - window]] += 1.0  # inside the window: output changes
    assert not torch.allclose(run(), base)
    base = run()
    pool.v[tables[0][prefix - window - 1]] += 1.0  # just outside: unchanged (not even in view)
    torch.testing.assert_close(run(), base)


def test_sinks_only_shrink_the_weights(kernel: bool) -> None:
    """A very negative sink changes nothing; a very positive one drives the output to zero."""
    gen = torch.Generator().manual_seed(2)
    pool = FakePool(torch.randn(32, HKV, D, generator=gen), torch.randn(32, HKV, DV, generator=gen))
    batch, _ = _batch([3], [4], LayerKind.FULL, None, 32, gen)
    q = torch.randn(3, HQ, D, generator=gen)
    backend = TorchBackend(pool, kernel)  # type: ignore[arg-type]
    meta = backend.plan(batch)
    plain = backend.forward(_layer(LayerKind.FULL), q, meta)
    torch.testing.assert_close(
        backend.forward(_layer(LayerKind.FULL), q, meta, torch.full((HQ,), -1e4)), plain
    )
    assert (
        backend.forward(_layer(LayerKind.FULL), q, meta, torch.full((HQ,), 1e4)).abs().max() < 1e-6
    )
