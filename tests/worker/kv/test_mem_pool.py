"""HybridKVPool: per-kind buffers, layer routing, the write path, startup checks."""

from __future__ import annotations

import pytest
import torch

from worker.kv import HybridKVPool, check_swa_pool_fits
from worker.models.spec import KindShape, LayerKind, ModelSpec

F, S = LayerKind.FULL, LayerKind.SWA
FULL_SHAPE = KindShape(num_q_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)
# MiMo-style SWA layers: other head count, v_head_dim != head_dim.
SWA_SHAPE = KindShape(num_q_heads=8, num_kv_heads=1, head_dim=8, v_head_dim=12, has_sinks=True)


def spec(kinds: tuple[LayerKind, ...] = (S, F, S, S), window: int | None = 4) -> ModelSpec:
    return ModelSpec(
        architecture="test",
        layer_kinds=kinds,
        window=window,
        full=FULL_SHAPE,
        swa=SWA_SHAPE,
        vocab_size=32,
        hidden_size=64,
        max_position_embeddings=256,
    )


def pool(s: ModelSpec | None = None, hybrid: bool = True, full: int = 32, swa: int = 16):
    return HybridKVPool(s or spec(), full, swa, 4, torch.float32, "cpu", hybrid=hybrid)


def test_buffer_shapes_per_kind():
    """Each layer gets its kind's heads/dims and its pool's row count (size + one page)."""
    p = pool()
    k, v = p.kv_buffers(1)
    assert k.shape == (36, 2, 16) and v.shape == (36, 2, 16)
    for layer in (0, 2, 3):
        k, v = p.kv_buffers(layer)
        assert k.shape == (20, 1, 8) and v.shape == (20, 1, 12)
    assert p.uses_swa_pool(0) and not p.uses_swa_pool(1)
    assert p.layers_in_pool(F) == 1 and p.layers_in_pool(S) == 3


def test_layers_have_distinct_buffers():
    """Layer index within a kind selects a separate tensor."""
    p = pool()
    ptrs = {p.kv_buffers(i)[0].data_ptr() for i in range(4)}
    assert len(ptrs) == 4


def test_non_hybrid_puts_every_layer_in_the_full_pool():
    """hybrid=False: SWA layers keep their shape but use full-pool rows and loc."""
    p = pool(hybrid=False)
    k, v = p.kv_buffers(0)
    assert k.shape == (36, 1, 8) and v.shape == (36, 1, 12)
    assert not any(p.uses_swa_pool(i) for i in range(4))
    assert p.layers_in_pool(F) == 4 and p.layers_in_pool(S) == 0
    loc = torch.tensor([5, 33])
    p.set_kv(0, torch.ones(2, 1, 8), torch.ones(2, 1, 12), loc)  # no swa_loc needed
    assert bool((k[loc] == 1).all())


def test_all_swa_model_full_pool_holds_no_buffers():
    """An all-SWA model keeps every layer in the SWA pool."""
    p = pool(spec((S, S)))
    assert p.layers_in_pool(F) == 0 and p.layers_in_pool(S) == 2
    assert all(p.uses_swa_pool(i) for i in range(2))
    assert p.nbytes() == 2 * 20 * (8 + 12) * 4


def test_no_swa_layers_is_not_hybrid():
    """A model without SWA layers needs no SWA pool whatever `hybrid` says."""
    p = pool(spec((F, F), window=None), swa=0)
    assert not p.hybrid and p.layers_in_pool(F) == 2


def test_write_path_full_and_swa():
    """Full layers write at loc; SWA layers at the translated swa_loc."""
    p = pool()
    loc, swa_loc = torch.tensor([4, 5, 6]), torch.tensor([12, 13, 14])
    k_full, v_full = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    p.set_kv(1, k_full, v_full, loc, swa_loc)  # full layer ignores swa_loc
    assert torch.equal(p.kv_buffers(1)[0][loc], k_full)
    k_swa, v_swa = torch.randn(3, 8), torch.randn(3, 12)  # flat heads are reshaped
    p.set_kv(2, k_swa, v_swa, loc, swa_loc)
    k, v = p.kv_buffers(2)
    assert torch.equal(k[swa_loc].reshape(3, 8), k_swa)
    assert torch.equal(v[swa_loc].reshape(3, 12), v_swa)
    assert bool((k[loc] == 0).all())  # nothing written at the full slots


def test_swa_loc_is_truncated_to_loc():
    """A padded swa_loc longer than loc writes only len(loc) rows."""
    p = pool()
    p.set_kv(
        0, torch.ones(2, 1, 8), torch.ones(2, 1, 12), torch.tensor([4, 5]), torch.tensor([8, 9, 10])
    )
    k, _ = p.kv_buffers(0)
    assert bool((k[[8, 9]] == 1).all()) and bool((k[10] == 0).all())


@pytest.mark.parametrize("layer", [0, 3])
def test_swa_write_without_swa_loc_raises(layer: int):
    """An SWA layer never translates on the write path."""
    p = pool()
    with pytest.raises(ValueError, match="swa_loc"):
        p.set_kv(layer, torch.ones(1, 1, 8), torch.ones(1, 1, 12), torch.tensor([4]))


def test_unknown_layer_raises():
    """Out-of-range layer ids are rejected."""
    with pytest.raises(IndexError):
        pool().kv_buffers(4)


@pytest.mark.parametrize(
    ("swa", "window", "page", "ok"),
    [(8, 4, 4, False), (12, 4, 4, True), (64, 127, 1, False), (129, 127, 1, True)],
)
def test_swa_pool_must_exceed_window_plus_page(swa: int, window: int, page: int, ok: bool):
    """Startup fails fast, naming both numbers, when swa_size <= window + page_size."""
    if ok:
        check_swa_pool_fits(swa, window, page)
        return
    with pytest.raises(ValueError, match=rf"window \({window}\) \+ page_size \({page}\)"):
        check_swa_pool_fits(swa, window, page)


def test_pool_refuses_too_small_swa_pool():
    """The pool runs the startup check for hybrid models only."""
    with pytest.raises(ValueError, match="cannot hold one request"):
        pool(swa=8)
    pool(swa=8, hybrid=False)  # one pool: the SWA size is irrelevant


def test_pool_bad_sizes():
    """Sizes must be whole pages; page size a power of two."""
    with pytest.raises(ValueError, match="multiple of page_size"):
        pool(full=30)
    with pytest.raises(ValueError, match="power of two"):
        HybridKVPool(spec(), 36, 18, 6, torch.float32, "cpu")
