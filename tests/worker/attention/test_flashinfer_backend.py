"""FlashInfer backend vs the torch reference on the same batches (GPU; skipped without CUDA).

Synthetic batches cover mixed decode/prefill, GQA, windows, sinks, softcap and MiMo's unequal
per-kind shapes; the tiny model then runs end to end (SWA freed and reused) on both backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from worker import attention
from worker.attention.base import AttentionLayer, AttnBatch, KVView
from worker.attention.torch_backend import TorchBackend
from worker.models.spec import KindShape, LayerKind, ModelSpec

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DTYPE = torch.bfloat16
ATOL = RTOL = 2e-2


def _flashinfer():
    return pytest.importorskip("flashinfer")


@dataclass
class FakePool:
    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype = DTYPE

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def _spec(shape: KindShape, window: int) -> ModelSpec:
    return ModelSpec("test", (LayerKind.FULL, LayerKind.SWA), window, shape, shape, 256, 64, 4096)


def _batch(kind: LayerKind, window: int, q_lens, prefix_lens, slots: int, gen: torch.Generator):
    perm = torch.randperm(slots - 1, generator=gen) + 1
    parts, starts, used = [], [], 0
    for q, p in zip(q_lens, prefix_lens):
        table = perm[used : used + p + q]
        used += p + q
        start = 0 if kind is LayerKind.FULL else max(0, p - window)
        starts.append(start)
        parts.append(table[start:])
    indptr = torch.cumsum(torch.tensor([0] + [len(x) for x in parts]), 0)
    positions = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix_lens, q_lens)])
    view = KVView(torch.cat(parts).cuda(), indptr.cuda(), tuple(starts))
    seq_lens = tuple(p + q for p, q in zip(prefix_lens, q_lens))
    return AttnBatch(tuple(q_lens), seq_lens, positions.cuda(), {kind: view}, window)


CASES = {
    # name: (kind, q heads, kv heads, head dim, v head dim, window, sinks, softcap)
    "full_gqa": (LayerKind.FULL, 8, 2, 128, 128, 64, False, None),
    "full_softcap": (LayerKind.FULL, 8, 4, 128, 128, 64, False, 50.0),
    "swa_window": (LayerKind.SWA, 8, 2, 64, 64, 31, False, None),
    "swa_sinks": (LayerKind.SWA, 8, 2, 64, 64, 31, True, None),
    "full_sinks": (LayerKind.FULL, 8, 1, 64, 64, 31, True, None),
    "swa_sinks_mimo_shape": (LayerKind.SWA, 8, 2, 192, 128, 128, True, None),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", list(CASES))
def test_flashinfer_matches_torch_backend(name: str) -> None:
    """Same pool, same mixed batch (decodes + chunks with and without prefix), bf16 tolerance."""
    _flashinfer()
    from worker.attention.flashinfer_backend import FlashInferBackend

    kind, hq, hkv, d, dv, window, with_sinks, softcap = CASES[name]
    gen = torch.Generator().manual_seed(0)
    slots = 4096
    pool = FakePool(
        torch.randn(slots, hkv, d, generator=gen).to("cuda", DTYPE),
        torch.randn(slots, hkv, dv, generator=gen).to("cuda", DTYPE),
    )
    q_lens, prefix = [1, 1, 37, 1, 200, 5], [300, 2, 0, 95, 150, 40]
    batch = _batch(kind, window, q_lens, prefix, slots, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to("cuda", DTYPE)
    sinks = (torch.randn(hq, generator=gen) * 2).cuda() if with_sinks else None
    layer = AttentionLayer(0, kind, hq, hkv, d, dv, scaling=d**-0.5, softcap=softcap)
    spec = _spec(KindShape(hq, hkv, d, dv, with_sinks), window)
    fi = FlashInferBackend(pool, spec, "cuda")  # type: ignore[arg-type]
    ref = TorchBackend(pool)  # type: ignore[arg-type]
    got = fi.forward(layer, q, fi.plan(batch), sinks)
    want = ref.forward(layer, q, ref.plan(batch), sinks)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@gpu
def test_tiny_model_end_to_end_on_both_backends(tmp_path) -> None:
    """The tiny model (sinks, 2x SWA KV heads) decodes with SWA freed and reused: FlashInfer's
    logits track the torch backend's step by step."""
    _flashinfer()
    from tests.worker.models.driver import Driver
    from worker.attention.flashinfer_backend import FlashInferBackend
    from worker.models.hf_config import load_spec
    from worker.models.loader import load_model
    from worker.models.tiny import ensure_tiny_model

    path = ensure_tiny_model(tmp_path)
    spec = load_spec(path)
    model = load_model(path, spec, dtype=DTYPE, device="cuda")
    runs = {}
    for name, make in {
        "torch": TorchBackend,
        "flashinfer": lambda pool: FlashInferBackend(pool, spec, "cuda"),
    }.items():
        drv = Driver(spec, model, page_size=16, swa_size=256, chunk=48, free_swa=True,
                     backend=make, device="cuda", dtype=DTYPE)  # fmt: skip
        a = drv.add(list(range(10, 150)), 24)
        b = drv.add(list(range(200, 290)), 24)
        drv.step([a])
        drv.run([a, b])
        runs[name] = (a, b)
    for ref, got in zip(runs["torch"], runs["flashinfer"]):
        same = 0
        while same < len(ref.out) and ref.out[same] == got.out[same]:
            same += 1
        assert same >= 8, f"backends diverged after {same} tokens"
        diff = (torch.stack(ref.logits[:same]) - torch.stack(got.logits[:same])).abs().max()
        assert diff < 0.15, f"max logit diff {diff:.3f}"


def test_flashinfer_is_refused_off_cuda() -> None:
    """Selecting FlashInfer on CPU (or without the package) fails with advice to use torch."""
    spec = _spec(KindShape(4, 2, 16, 16), 7)
    pool = FakePool(torch.zeros(8, 2, 16), torch.zeros(8, 2, 16), torch.float32)
    with pytest.raises((ImportError, ValueError), match="attention_backend='torch'"):
        attention.create_backend("flashinfer", pool, spec, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown; choose one of torch, flashinfer"):
        attention.create_backend("triton", pool, spec, "cpu")  # type: ignore[arg-type]


def test_unsupported_head_dims_are_refused_with_the_layer_kind() -> None:
    """FlashInfer's kernels take head dims in multiples of 16 up to 256: anything else is
    refused when the backend is made, naming the kind and the dim (MiMo's 192/128 passes)."""
    from worker.attention.flashinfer_backend import check_head_dims

    check_head_dims(_spec(KindShape(8, 2, 192, 128, True), 127))
    check_head_dims(_spec(KindShape(8, 2, 64, 64, True), 127))
    with pytest.raises(ValueError, match="full layers' v_head_dim 8: .*multiples of 16 up to 256"):
        check_head_dims(_spec(KindShape(4, 1, 16, 8), 7))
    with pytest.raises(ValueError, match="head_dim 320"):
        check_head_dims(_spec(KindShape(4, 1, 320, 320), 7))


def test_sink_kernels_are_chosen_per_batch_shape() -> None:
    """A sink wrapper is built for one kernel: decodes and short chunks (<= 64 query rows) get
    FA2, longer chunks FlashInfer's choice (FA3 on Hopper), each batch its own wrapper key;
    wrappers without sinks leave the choice to FlashInfer's plan."""
    from worker.attention.flashinfer_backend import _PlanKey, sink_backend

    assert sink_backend((1,) * 256) == "fa2"
    assert sink_backend((1, 64, 1)) == "fa2"
    assert sink_backend((1, 65)) == "auto"
    layer = AttentionLayer(0, LayerKind.SWA, 8, 2, 64, 64, scaling=0.125)

    def batch(q_lens: tuple[int, ...]) -> AttnBatch:
        return AttnBatch(q_lens, q_lens, torch.zeros(sum(q_lens)), {}, 31)

    decode, prefill = batch((1, 1, 1)), batch((1, 300))
    assert _PlanKey.of(layer, decode, True).backend == "fa2"
    assert _PlanKey.of(layer, prefill, True).backend == "auto"
    assert _PlanKey.of(layer, decode, True) != _PlanKey.of(layer, prefill, True)
    assert _PlanKey.of(layer, decode, False).backend == "auto"


def test_the_gpu_extra_pins_a_flashinfer_without_the_module_name_collision() -> None:
    """FlashInfer 0.7.0 to 0.7.2.post1 named the sink kernel's module without its head dims, so
    GPT-OSS's (64) and MiMo's (192/128) shapes loaded one module in a process: the `gpu` extra
    admits 0.7.4 and later only."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    pyproject = Path(__file__).parents[3] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["gpu"]
    (pin,) = [Requirement(r) for r in extra if Requirement(r).name == "flashinfer-python"]
    for bad in ("0.7.0", "0.7.2", "0.7.2.post1", "0.7.3"):
        assert not pin.specifier.contains(bad), (pin, bad)
    assert pin.specifier.contains("0.7.4") and pin.specifier.contains("0.8.0")


def test_the_two_gpu_test_model_has_head_dims_flashinfer_runs(tmp_path) -> None:
    """The MiMo shapes the 2-GPU FlashInfer test uses pass the head-dim check; the default tiny
    ones (16 / 8) are refused, which is why that test overrides them."""
    from tests.worker.models.hf_tiny import make_tiny
    from tests.worker.parallel.test_tp_gpu import FLASHINFER_MIMO
    from worker.attention.flashinfer_backend import check_head_dims
    from worker.models.hf_config import load_spec

    check_head_dims(load_spec(make_tiny("mimo_v2_flash", tmp_path / "fi", **FLASHINFER_MIMO).path))
    with pytest.raises(ValueError, match="v_head_dim 8"):
        check_head_dims(load_spec(make_tiny("mimo_v2_flash", tmp_path / "default").path))


def test_a_layer_runs_into_an_output_that_is_not_zeroed() -> None:
    """FlashInfer's run zero-fills an output it allocates itself; the backend hands it an empty
    one of the layer's [tokens, q heads, v head dim] instead (no fill kernel per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from worker.attention.flashinfer_backend import run_wrapper

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    class Wrapper:
        def run(self, q: torch.Tensor, paged: object, *args: object, out: torch.Tensor) -> torch.Tensor:
            self.args, self.out = args, out
            return out

    layer = AttentionLayer(0, LayerKind.SWA, 8, 2, 32, 16, scaling=0.5)
    q, paged = torch.randn(5, 8, 32), (torch.zeros(4, 1, 2, 32), torch.zeros(4, 1, 2, 16))
    for sinks in (None, torch.zeros(8)):
        wrapper = Wrapper()
        with Ops() as ops:
            got = run_wrapper(wrapper, q, paged, sinks, layer)
        assert got is wrapper.out and got.shape == (5, 8, 16)
        assert not [n for n in ops.names if "zero" in n or "fill" in n], ops.names
        assert len(wrapper.args) == (0 if sinks is None else 2)
