"""The fused MXFP4 MoE kernel's side that a CPU can check (the kernel itself needs an SM90 GPU:
`bench/gpu_check.py`'s quantized step compares it there): the layout conversion's properties,
the call's wiring against an emulation of the kernel's documented arithmetic (FlashInfer 0.7.4:
fc1 rows [linear; gate], SwigluBias, fc2, weighted sum over the token's experts held here),
and the call binding FlashInfer's real signature where the package imports."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.models.moe import ExpertShard, GptOssMoE
from worker.models.quant import mxfp4_kernel as mk
from worker.models.quant.mxfp4 import dequantize_mxfp4
from worker.models.quant.resident import Mxfp4Experts

H, INTER, E, K = 96, 64, 4, 2  # H is not a multiple of 128: the layout pads it
ALPHA, LIMIT = 1.702, 7.0


def _moe(seed: int = 0) -> GptOssMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = GptOssMoE(H, INTER, E, K, ALPHA, LIMIT)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        experts = Mxfp4Experts.from_experts(moe.experts)
        for name, b in experts.named_buffers():
            hi = 256 if name.endswith("blocks") else 128
            lo = 0 if name.endswith("blocks") else 122
            b.copy_(torch.randint(lo, hi, b.shape, generator=gen, dtype=torch.int32).to(torch.uint8))
    moe.experts = experts
    return moe


def _layout(moe: GptOssMoE) -> mk.Sm90Layout:
    x = moe.experts
    return mk.sm90_layout(x.gate_up_proj_blocks, x.gate_up_proj_scales, x.gate_up_proj_bias,
                          x.down_proj_blocks, x.down_proj_scales, x.down_proj_bias, torch.float32)  # fmt: skip


def _dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(blocks.unflatten(-1, (-1, 16)), scales)


def emulate(**call: Any) -> torch.Tensor:
    """`cutlass_fused_moe`'s arithmetic as its 0.7.4 source states it, on the un-interleaved
    layout: per (token, expert held here) fc1 + bias, linear = first half, gate = second,
    SwigluBias, fc2 + bias, times the token's scale, summed."""
    x, idx, w = call["input"].float(), call["token_selected_experts"], call["token_final_scales"]
    fc1 = _dequantized(call["fc1_expert_weights"], call["quant_scales"][0])
    fc2 = _dequantized(call["fc2_expert_weights"], call["quant_scales"][1])
    local = fc1.shape[0]
    first = call["ep_rank"] * local
    out = torch.zeros(x.shape[0], fc2.shape[1])
    for t in range(x.shape[0]):
        for slot in range(idx.shape[1]):
            e = int(idx[t, slot]) - first
            if not 0 <= e < local:
                continue
            h = fc1[e] @ x[t] + call["fc1_expert_biases"][e]
            linear, gate = h.chunk(2)
            a, b, lim = (call[k][e] for k in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"))
            gate, linear = gate.clamp(max=lim), linear.clamp(-lim, lim)
            act = gate * torch.sigmoid(gate * a) * (linear + b)
            out[t] += w[t, slot] * (fc2[e] @ act + call["fc2_expert_biases"][e])
    return out.to(call["output_dtype"])


def test_up_first_round_trips_and_moves_the_up_rows_first() -> None:
    t = torch.arange(2 * 6 * 3).reshape(2, 6, 3)  # rows: gate0, up0, gate1, up1, gate2, up2
    moved = mk.up_first(t)
    assert torch.equal(moved[:, :3], t[:, 1::2]) and torch.equal(moved[:, 3:], t[:, ::2])
    assert torch.equal(mk.interleaved(moved), t)


def test_layout_shapes_dtypes_and_padding() -> None:
    moe = _moe()
    layout = _layout(moe)
    hp, ip = 128, 128
    assert layout.fc1.shape == (E, 2 * ip, hp // 2) and layout.fc1.dtype == torch.uint8
    assert layout.fc1_scales.shape == (E, 2 * ip, hp // 32) and layout.fc1_scales.dtype == torch.uint8
    assert layout.fc2.shape == (E, hp, ip // 2) and layout.fc2_scales.shape == (E, hp, ip // 32)
    assert layout.fc1_bias.shape == (E, 2 * ip) and layout.fc2_bias.shape == (E, hp)
    assert layout.hidden == H and layout.hidden_padded == hp
    # Padded rows and columns: zero codes with scale 2 ** 0 (value 0), zero biases.
    for half in (layout.fc1[:, :ip], layout.fc1[:, ip:]):
        assert not half[:, INTER:].any() and not half[:, :, H // 2 :].any()
    assert not layout.fc2[:, H:].any() and not layout.fc2[:, :, INTER // 2 :].any()
    assert (layout.fc1_scales[:, INTER:ip] == mk.ONE).all() and not layout.fc1_bias[:, INTER:ip].any()
    # The real rows are the stored ones, up first.
    stored = moe.experts.gate_up_proj_blocks.flatten(2)
    assert torch.equal(layout.fc1[:, :INTER, : H // 2], stored[:, 1::2])
    assert torch.equal(layout.fc1[:, ip : ip + INTER, : H // 2], stored[:, ::2])


def _hold(moe: GptOssMoE, mine: range) -> None:
    """Keep only the experts in `mine`, as a tensor-parallel rank does (`ExpertShard`)."""
    ex = moe.experts
    with torch.no_grad():
        for name, p in list(ex.named_parameters(recurse=False)):
            setattr(ex, name, torch.nn.Parameter(p[mine.start : mine.stop].clone()))
        for name, b in list(ex.named_buffers(recurse=False)):
            ex.register_buffer(name, b[mine.start : mine.stop].clone())
    moe.shard = ExpertShard(mine)


@pytest.mark.parametrize("mine", [range(E), range(E // 2, E)])
def test_fused_call_equals_the_per_expert_path_under_the_kernels_arithmetic(mine: range) -> None:
    """`GptOssMoE.mix` through `FusedMxfp4` (its padding, slicing and `kernel_arguments`) with an
    emulated kernel equals the per-expert dequantization; on a rank holding half the experts
    (expert parallelism), that rank's partial sum."""
    moe, fused_moe = _moe(), _moe()
    for m in (moe, fused_moe):
        _hold(m, mine)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    fused_moe.experts.use_fused(mk.FusedMxfp4(_layout(fused_moe), ALPHA, LIMIT, emulate))
    with torch.no_grad():
        want, got = moe.mix(x), fused_moe.mix(x)
    assert got.shape == x.shape and got.is_contiguous() and want.abs().max() > 1
    # float32, the same products summed in another order: rounding only
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())
    assert fused_moe.experts.gate_up_proj_blocks.numel() == 0  # the packed copy is freed
    assert fused_moe.experts.weight_numel() == moe.experts.weight_numel()


def test_the_kernel_is_declined_off_sm90_with_its_reason() -> None:
    moe = _moe()
    assert mk.unavailable(torch.device("cpu"), torch.bfloat16) == "the W4A16 MXFP4 MoE kernel is CUDA's (device cpu)"
    assert mk.use_fused_kernels(moe, torch.device("cpu"), torch.bfloat16) is not None
    assert moe.experts.fused is None and moe.experts.gate_up_proj_blocks.numel() > 0
    assert mk.use_fused_kernels(torch.nn.Linear(2, 2), torch.device("cpu"), torch.bfloat16) is None  # nothing to do


def test_binds_names_a_call_the_function_does_not_take() -> None:
    def narrow(input: torch.Tensor, token_selected_experts: torch.Tensor) -> None: ...

    why = mk.binds(narrow)
    assert why is not None and "does not take the call" in why


def test_the_call_binds_flashinfers_signature_and_its_scale_fold_takes_the_layout() -> None:
    """Against the real package (skipped where flashinfer does not import, e.g. CI's CPU venv):
    `cutlass_fused_moe` accepts exactly the keywords we pass, and the pure-torch scale fold
    takes our padded scales (rows a multiple of 64, K of 128)."""
    fused_moe = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer is not installed")
    assert mk.binds(fused_moe.cutlass_fused_moe) is None
    layout = _layout(_moe())
    folded = fused_moe.interleave_moe_scales_for_sm90_mixed_gemm(layout.fc1_scales, mk.SCALE_GROUP)
    assert folded.dtype == torch.uint8 and folded.numel() == layout.fc1_scales.numel()
    assert folded.shape[:3] == (E, layout.fc1_scales.shape[1] // 64, layout.hidden_padded // 128)
