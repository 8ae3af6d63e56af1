"""The small-step linear kernel (`csrc/linear.c`) against a float64 matmul: every tile height,
panel counts with a partial last panel, odd inner sizes, with and without bias."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.models.panel_kernel import PANEL, pack_panels, pad_bias, panel_kernel, panel_linear

pytestmark = pytest.mark.skipif(
    panel_kernel() is None, reason="the small-step linear kernel did not build here (no C compiler?)"
)


def _check(m: int, n: int, k: int, bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    got = panel_linear(panel_kernel(), x, pack_panels(w), pad_bias(b, n), n)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(1, 70),  # tiles of 1..6 rows, one to twelve of them
    n=st.integers(1, 70),  # one to five panels, the last partial
    k=st.integers(1, 90),  # inner sizes not divisible by the 2- and 4-set unroll
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_equals_a_float64_matmul(m: int, n: int, k: int, bias: bool, seed: int) -> None:
    _check(m, n, k, bias, seed)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 64])
def test_model_sized_layers(m: int) -> None:
    """The 46M Gemma-3's shapes: fused qkv, o, fused gate/up, down."""
    for n, k in [(768, 512), (512, 512), (4096, 512), (512, 2048)]:
        _check(m, n, k, bias=m % 2 == 0, seed=m)


def test_strided_and_transposed_rows_are_read_right() -> None:
    """Rows that are a view of a wider tensor are read in place (their row stride passed);
    rows whose features are not contiguous are copied first."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=gen) / 24**0.5
    wide = torch.randn(5, 64, generator=gen)
    for rows in (wide[:, 8:32], torch.randn(24, 5, generator=gen).t()):
        got = panel_linear(panel_kernel(), rows, pack_panels(w), None, 40)
        torch.testing.assert_close(got, rows @ w.t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="float32"):
        panel_linear(panel_kernel(), wide.double(), pack_panels(w), None, 40)


def test_panels_hold_the_weight_k_major_and_zero_padded() -> None:
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = pack_panels(w)
    assert panels.shape == (2, 3, PANEL)
    assert torch.equal(panels[0, 1], w[:16, 1]) and torch.equal(panels[1, 2, :4], w[16:, 2])
    assert not panels[1, :, 4:].any()
    padded = pad_bias(torch.ones(20), 20)
    assert padded is not None and padded.shape == (32,) and padded.sum() == 20


def test_two_kernels_load_side_by_side(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention and linear kernels, freshly built into one cache and loaded one after the
    other in one process, each give their own function (dlopen knows a library by its name)."""
    from worker.attention import cpu_kernel

    monkeypatch.setenv("SWASERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    panel_kernel.cache_clear()
    cpu_kernel._load.cache_clear()
    try:
        assert panel_kernel() is not None and cpu_kernel._load() is not None
        assert len(list((tmp_path / "cache").iterdir())) == 2
        _check(3, 20, 7, bias=True, seed=0)
    finally:
        panel_kernel.cache_clear()
        cpu_kernel._load.cache_clear()
