"""oneDNN-packed linears (`compile: auto` on CPU): the layers are replaced, and greedy tokens and
logits still match transformers' eager model (docs/design.md §19)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.worker.models.conftest import Archs, prompt_of
from tests.worker.models.driver import Driver
from tests.worker.models.hf_tiny import ARCHS
from tests.worker.models.test_parity import MAX_NEW, check_against_hf
from worker.models.loader import load_model
from worker.models.packed import (
    PACK_MIN_ELEMENTS,
    PANEL_ROWS_MAX,
    PANEL_ROWS_MAX_THREADED,
    PackedLinear,
    PackedSplitLinear,
    PackReport,
    keeps_panel_copies,
    pack_linears,
    packable_bytes,
    packing_unsupported,
    panel_rows_max,
)
from worker.models.panel_kernel import panel_kernel, panel_linear
from worker.models.self_attention import SelfAttention

needs_kernel = pytest.mark.skipif(
    panel_kernel() is None, reason="the small-step linear kernel did not build here (no C compiler?)"
)


def _packed_model(archs: Archs, name: str, panels: str = "off") -> nn.Module:
    arch = archs[name]
    model = load_model(arch.tiny.path, arch.spec)  # a fresh copy: the shared one stays eager
    weights = packable_bytes(model, torch.float32, 0)
    report = pack_linears(model, torch.device("cpu"), torch.float32, min_elements=0, panel_copies=panels)
    assert report.packed > 0 and report.skipped_reason is None
    assert report.panel_copy_bytes == (weights if panels == "on" else 0)
    kept = [m.panels for m in model.modules() if isinstance(m, PackedLinear)]
    assert all((t is not None) == (panels == "on") for t in kept)
    assert not any(type(m) is nn.Linear for m in model.modules()), "an nn.Linear was left eager"
    assert isinstance(model.lm_head, PackedLinear)
    attention = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert attention and report.fused >= len(attention)
    for m in attention:  # q/k/v packed as one
        assert isinstance(m.qkv_proj, PackedSplitLinear) and m.q_proj is None and m.v_proj is None
    return model


@pytest.mark.parametrize("panels", ["off", pytest.param("on", marks=needs_kernel)])
@pytest.mark.parametrize("name", ARCHS)
def test_packed_model_matches_transformers(archs: Archs, name: str, panels: str) -> None:
    """A prompt of ~3 windows plus a 2-token one, prefilled and decoded together, then a third
    prompt alone, packed; with panel copies the small steps (the decodes, the short prefills)
    run on the C kernel."""
    arch = archs[name]
    drv = Driver(arch.spec, _packed_model(archs, name, panels), page_size=4)
    seqs = [drv.add(prompt_of(n, seed=50 + n), MAX_NEW) for n in (3 * arch.window + 1, 2)]
    drv.run(seqs)
    alone = drv.add(prompt_of(arch.window + 3, seed=7), MAX_NEW)
    drv.run([alone])
    for s in [*seqs, alone]:
        check_against_hf(arch, s)


_NO_BF16 = packing_unsupported(torch.device("cpu"), torch.bfloat16)


@pytest.mark.skipif(_NO_BF16 is not None, reason=f"{_NO_BF16} (oneDNN's bfloat16 packing needs AVX-512 or AVX-NE-CONVERT)")
def test_packed_linear_equals_linear_in_bfloat16() -> None:
    """bfloat16 weights pack too, and any leading shape works."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    packed = PackedLinear(lin.weight, lin.bias)
    torch.testing.assert_close(packed(x), lin(x), rtol=1.6e-2, atol=1e-2)
    assert packed(x[:0]).shape == (0, 5, 48)


def test_bfloat16_packs_only_where_onednn_can() -> None:
    """A bfloat16 model packs on a CPU whose oneDNN does bfloat16; elsewhere (AVX2 only) it stays
    eager and the report says why, instead of the reorder failing at load."""
    model = nn.Sequential(nn.Linear(256, 256)).to(torch.bfloat16)
    report = pack_linears(model, torch.device("cpu"), torch.bfloat16, min_elements=0)
    if _NO_BF16 is None:
        assert report.packed == 1 and isinstance(model[0], PackedLinear)
    else:
        assert report == PackReport(0, _NO_BF16) and type(model[0]) is nn.Linear
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert model(x).shape == (2, 256)


def test_small_layers_stay_eager_by_default() -> None:
    """Below PACK_MIN_ELEMENTS the packed call's fixed cost outweighs it: only the big one packs."""
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(512, PACK_MIN_ELEMENTS // 512))
    assert pack_linears(model, torch.device("cpu"), torch.float32).packed == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)


def test_no_packing_off_cpu() -> None:
    """A non-CPU device is refused with a reason and the model is left as it was."""
    model = nn.Sequential(nn.Linear(4, 4))
    report = pack_linears(model, torch.device("cuda"), torch.float32)
    assert report.packed == 0 and "CPU" in (report.skipped_reason or "")
    assert type(model[0]) is nn.Linear


class _Pair(nn.Module):
    FUSED_LINEARS = (("ab", ("a", "b")),)

    def __init__(self, a: nn.Linear, b: nn.Linear) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.ab: nn.Module | None = None


def test_a_fused_group_returns_each_members_output() -> None:
    torch.manual_seed(1)
    a, b = nn.Linear(64, 48), nn.Linear(64, 16)
    x = torch.randn(5, 64)
    want = (a(x), b(x))
    pair = _Pair(a, b)
    report = pack_linears(pair, torch.device("cpu"), torch.float32, min_elements=0)
    assert report.fused == 1 and pair.a is None and isinstance(pair.ab, PackedSplitLinear)
    got = pair.ab(x)
    assert [g.shape for g in got] == [(5, 48), (5, 16)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_members_that_differ_are_packed_one_by_one() -> None:
    """A bias on one member only, or different inputs: no fusion; each still packs alone."""
    for a, b in ((nn.Linear(64, 48), nn.Linear(64, 16, bias=False)), (nn.Linear(64, 48), nn.Linear(32, 16))):
        pair = _Pair(a, b)
        report = pack_linears(pair, torch.device("cpu"), torch.float32, min_elements=0)
        assert report.fused == 0 and pair.ab is None
        assert isinstance(pair.a, PackedLinear) and isinstance(pair.b, PackedLinear)


def test_a_packed_linear_says_what_it_is() -> None:
    packed = PackedLinear(torch.zeros(8, 4), None)
    assert "in_features=4, out_features=8, oneDNN-packed" in repr(packed)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_a_panel_copy_serves_small_steps(bias: bool, threads: int) -> None:
    """Up to `panel_rows_max()` rows (64 on one torch thread, 6 on more) the product is the
    kernel's over the panels, bit for bit; from one row more it is oneDNN's over the packed
    weight, bit for bit; both equal F.linear."""
    torch.manual_seed(2)
    lin = nn.Linear(96, 80, bias=bias)
    with_copy, without = PackedLinear(lin.weight, lin.bias, panel_copy=True), PackedLinear(lin.weight, lin.bias)
    assert with_copy.panels is not None and without.panels is None
    assert with_copy.panels.shape == (5, 96, 16) and with_copy.panels.is_contiguous()
    assert "panel copy for small steps" in repr(with_copy)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        limit = panel_rows_max()
        assert limit == (PANEL_ROWS_MAX if threads == 1 else PANEL_ROWS_MAX_THREADED)
        for rows in sorted({1, 2, 5, limit - 1, limit, limit + 1, 70}):
            x = torch.randn(rows, 96)
            got = with_copy(x)
            if rows <= limit:
                want = panel_linear(panel_kernel(), x, with_copy.panels, with_copy.panel_bias, 80)
            else:
                want = without(x)
            assert torch.equal(got, want), rows
            torch.testing.assert_close(got, lin(x).detach(), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous)
    assert with_copy(torch.randn(1, 1, 96)).shape == (1, 1, 80)  # one row under a leading shape


def test_a_panel_copy_of_a_half_precision_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="float32 only"):
        PackedLinear(torch.zeros(8, 4, dtype=torch.bfloat16), None, panel_copy=True)


def test_panel_copies_are_kept_when_asked_or_when_they_fit() -> None:
    gib = 1 << 30
    assert keeps_panel_copies("on", torch.float32, 100 * gib, gib)
    assert not keeps_panel_copies("on", torch.bfloat16, 1, 100 * gib)  # the kernel is float32
    assert not keeps_panel_copies("off", torch.float32, 1, 100 * gib)
    assert keeps_panel_copies("auto", torch.float32, gib, 4 * gib)  # a quarter
    assert not keeps_panel_copies("auto", torch.float32, gib + 1, 4 * gib)
    assert not keeps_panel_copies("auto", torch.bfloat16, 1, 100 * gib)
    assert not keeps_panel_copies("auto", torch.float32, 1, 100 * gib, threads=4)  # measured on one
    assert keeps_panel_copies("on", torch.float32, 1, 100 * gib, threads=4)
    with pytest.raises(ValueError, match="auto, on or off"):
        keeps_panel_copies("yes", torch.float32, 1, gib)


def test_a_kernel_that_does_not_build_means_no_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """`on` without the kernel (no compiler, a failed build): the packed weights alone."""
    import worker.models.packed as packed_module

    monkeypatch.setattr(packed_module, "panel_kernel", lambda: None)
    model = nn.Sequential(nn.Linear(64, 64))
    report = pack_linears(model, torch.device("cpu"), torch.float32, min_elements=0, panel_copies="on")
    assert report.packed == 1 and report.panel_copy_bytes == 0
    assert isinstance(model[0], PackedLinear) and model[0].panels is None


def test_packable_bytes_counts_what_packs() -> None:
    """A fused group's small members count (they pack together), a small lone layer does not."""
    big, small_a, small_b = nn.Linear(512, 512, bias=False), nn.Linear(64, 48), nn.Linear(64, 16)
    model = nn.Sequential(big, _Pair(small_a, small_b), nn.Linear(8, 8))
    assert packable_bytes(model, torch.float32, 512 * 512) == 512 * 512 * 4  # the pair: 64 x 64
    assert packable_bytes(model, torch.float32, 0) == (512 * 512 + 64 * 64 + 8 * 8) * 4
    report = pack_linears(model, torch.device("cpu"), torch.float32, min_elements=0, panel_copies="on")
    assert report.panel_copy_bytes == ((512 * 512 + 64 * 64 + 8 * 8) * 4 if panel_kernel() else 0)
