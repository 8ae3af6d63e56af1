"""GPT-OSS's MXFP4 experts through FlashInfer's fused MoE kernel on SM90 (docs/design.md §16).

FlashInfer 0.7.4's `cutlass_fused_moe` has a W4A16 path for Hopper: bf16 activations, MXFP4
weights as uint8 (two E2M1 codes a byte) with one E8M0 scale per 32 along K
(`use_w4_group_scaling=True`, uint8 weights, bf16 input: the binding's `isWFP4A16Quant`, two
`quant_scales`, fc1's then fc2's). What it wants, read from its 0.7.4 source:

| | layout |
| --- | --- |
| fc1 | ``[E, 2 * I, H / 2]`` uint8, rows ``[linear; gate]``: the activation reads the linear half at column ``j`` and the gate at ``j + I`` (`doActivationKernel`) |
| fc2 | ``[E, H, I / 2]`` uint8 |
| scales | ``[E, rows, K / 32]`` uint8, folded by `interleave_moe_scales_for_sm90_mixed_gemm` (rows a multiple of 64, K of 128) |
| weights | interleaved by `interleave_moe_weights_for_sm90_mixed_gemm` (a CUDA op of the JIT module) |
| activation | ``SwigluBias``: ``min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(linear, ±limit) + beta)``, per-expert float32 alpha, beta, limit |

GPT-OSS stores fc1 as ``gate_up_proj`` rows interleaved (gate 0, up 0, gate 1, ...) and its
GLU is that SwigluBias with beta 1 (`GptOssExperts.expert`), so the conversion (`sm90_layout`,
pure tensor functions, tested on the CPU against the kernel's documented arithmetic) moves the
up rows first and pads H and I to multiples of `PAD` with zero codes (the binding refuses
MXFP4 sizes that are not multiples of 128; GPT-OSS's are 2880): padded inputs are zeros, padded
outputs are dropped. FlashInfer's two interleaves then run on the device.

NOTE: nothing here has run on a GPU. The kernel path is taken only where `unavailable` finds
nothing missing (a CUDA SM90 device, bf16, FlashInfer's fused MoE importable and its signature
binding the exact call `kernel_arguments` builds); otherwise the experts keep the per-expert
dequantization, and the reason is logged.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.quant.base import sm90_unavailable

logger = logging.getLogger(__name__)

PAD = 128  # H and I are padded to multiples of this (MXFP4 alignment of the binding)
SCALE_GROUP = 32
ONE = 127  # E8M0 2 ** 0: the scale of padded (all-zero) blocks


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def up_first(t: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's fc1 rows (dim 1) interleaved gate, up, gate, up, ... -> ``[up; gate]``."""
    pairs = t.unflatten(1, (-1, 2))
    return torch.cat((pairs.select(2, 1), pairs.select(2, 0)), dim=1)


def interleaved(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `up_first`: ``[up; gate]`` rows -> gate, up, gate, up, ..."""
    up, gate = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _pad(t: torch.Tensor, rows: int, cols: int | None, value: int | float) -> torch.Tensor:
    """`t` ``[E, r, c, ...]`` padded to `rows` (dim 1) and, unless None, `cols` (dim 2)."""
    # F.pad lists the last dim first: dims 3.. unpadded, then dim 2, then dim 1.
    pad = [0, 0] * (t.dim() - 3) + [0, 0 if cols is None else cols - t.shape[2], 0, rows - t.shape[1]]
    if t.dtype == torch.uint8:  # F.pad has no uint8 kernel on every device: pad as int16
        return F.pad(t.to(torch.int16), pad, value=value).to(torch.uint8)
    return F.pad(t, pad, value=value)


@dataclass(frozen=True)
class Sm90Layout:
    """The experts as the kernel reads them, before FlashInfer's own interleaves."""

    fc1: torch.Tensor  # uint8 [E, 2 * Ip, Hp / 2]: [up; gate]
    fc1_scales: torch.Tensor  # uint8 [E, 2 * Ip, Hp / 32]
    fc1_bias: torch.Tensor  # [E, 2 * Ip]
    fc2: torch.Tensor  # uint8 [E, Hp, Ip / 2]
    fc2_scales: torch.Tensor  # uint8 [E, Hp, Ip / 32]
    fc2_bias: torch.Tensor  # [E, Hp]
    hidden: int  # H before padding

    @property
    def hidden_padded(self) -> int:
        return self.fc2.shape[1]


def sm90_layout(
    gate_up_blocks: torch.Tensor,  # uint8 [E, 2I, H/32, 16] (the checkpoint's)
    gate_up_scales: torch.Tensor,  # uint8 [E, 2I, H/32]
    gate_up_bias: torch.Tensor,  # [E, 2I]
    down_blocks: torch.Tensor,  # uint8 [E, H, I/32, 16]
    down_scales: torch.Tensor,  # uint8 [E, H, I/32]
    down_bias: torch.Tensor,  # [E, H]
    bias_dtype: torch.dtype,
) -> Sm90Layout:
    """GPT-OSS's stored experts in the kernel's order and padding (zero codes, scale 2 ** 0)."""
    e, rows, groups, _ = gate_up_blocks.shape
    inter, hidden = rows // 2, groups * SCALE_GROUP
    ip, hp = _round_up(inter, PAD), _round_up(hidden, PAD)

    def fc1_part(t: torch.Tensor, cols: int | None, value: int | float) -> torch.Tensor:
        up, gate = up_first(t).chunk(2, dim=1)
        return torch.cat((_pad(up, ip, cols, value), _pad(gate, ip, cols, value)), dim=1)

    return Sm90Layout(
        fc1=fc1_part(gate_up_blocks.flatten(2), hp // 2, 0),
        fc1_scales=fc1_part(gate_up_scales, hp // SCALE_GROUP, ONE),
        fc1_bias=fc1_part(gate_up_bias.to(bias_dtype).unsqueeze(-1), None, 0).squeeze(-1),
        fc2=_pad(down_blocks.flatten(2), hp, ip // 2, 0),
        fc2_scales=_pad(down_scales, hp, ip // SCALE_GROUP, ONE),
        fc2_bias=_pad(down_bias.to(bias_dtype).unsqueeze(-1), hp, None, 0).squeeze(-1),
        hidden=hidden,
    )


def kernel_arguments(
    x: torch.Tensor,
    top_idx: torch.Tensor,
    top_w: torch.Tensor,
    weights: Sm90Layout,
    activation: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # alpha, beta, limit [E]
    experts: range,
    total_experts: int,
) -> dict[str, Any]:
    """The keyword arguments of the `cutlass_fused_moe` call (`x` already padded). Under
    tensor parallelism a rank holds a contiguous range of whole experts: expert parallelism."""
    alpha, beta, limit = activation
    return {
        "input": x,
        "token_selected_experts": top_idx.to(torch.int32),
        "token_final_scales": top_w.to(torch.float32),
        "fc1_expert_weights": weights.fc1,
        "fc2_expert_weights": weights.fc2,
        "output_dtype": x.dtype,
        "quant_scales": [weights.fc1_scales, weights.fc2_scales],
        "fc1_expert_biases": weights.fc1_bias,
        "fc2_expert_biases": weights.fc2_bias,
        "swiglu_alpha": alpha,
        "swiglu_beta": beta,
        "swiglu_limit": limit,
        "ep_size": total_experts // len(experts),
        "ep_rank": experts.start // len(experts),
        "use_w4_group_scaling": True,
        # NOTE: the fused finalize sums a token's experts with atomics (run-to-run different
        # roundings); the separate finalize is deterministic, as the engine's parity checks need.
        "use_fused_finalize": False,
    }


def binds(fn: Callable[..., Any]) -> str | None:
    """None when `fn`'s signature accepts the call `kernel_arguments` builds; else why not."""
    meta = torch.empty(1, 1, device="meta")
    layout = Sm90Layout(meta, meta, meta, meta, meta, meta, hidden=1)
    call = kernel_arguments(meta, meta, meta, layout, (meta, meta, meta), range(1), 1)
    try:
        inspect.signature(fn).bind(**call)
    except TypeError as exc:
        return f"{getattr(fn, '__qualname__', fn)} does not take the call: {exc}"
    return None


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused kernel cannot run the experts here; None when it can."""
    reason = sm90_unavailable(device, dtype, "the W4A16 MXFP4 MoE kernel")
    if reason is not None:
        return reason
    try:
        from flashinfer.fused_moe import cutlass_fused_moe
    except ImportError as exc:
        return f"flashinfer.fused_moe does not import ({exc})"
    return binds(cutlass_fused_moe)


class FusedMxfp4(nn.Module):
    """One MoE layer's experts in the kernel's layout (`Sm90Layout` after FlashInfer's
    interleaves), with GPT-OSS's activation constants per expert."""

    NAMES = ("fc1", "fc1_scales", "fc1_bias", "fc2", "fc2_scales", "fc2_bias")
    alpha: torch.Tensor
    beta: torch.Tensor
    limit: torch.Tensor

    def __init__(self, layout: Sm90Layout, alpha: float, limit: float, run: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        for name in self.NAMES:
            self.register_buffer(name, getattr(layout, name))
        self.hidden, self.run = layout.hidden, run
        e, dev = layout.fc1.shape[0], layout.fc1.device
        for name, value in (("alpha", alpha), ("beta", 1.0), ("limit", limit)):
            self.register_buffer(name, torch.full((e,), value, dtype=torch.float32, device=dev))

    def layout(self) -> Sm90Layout:
        tensors: dict[str, torch.Tensor] = {n: getattr(self, n) for n in self.NAMES}
        return Sm90Layout(**tensors, hidden=self.hidden)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, experts: range,
                total_experts: int) -> torch.Tensor:  # fmt: skip
        """``[T, H]`` -> ``[T, H]``: the sum over each token's experts held here."""
        weights = self.layout()
        padded = F.pad(x, (0, weights.hidden_padded - self.hidden))
        activation = (self.alpha, self.beta, self.limit)
        out = self.run(**kernel_arguments(padded, top_idx, top_w, weights, activation, experts, total_experts))
        return out[:, : self.hidden].contiguous()


def use_fused_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Give every `Mxfp4Experts` of `model` the fused kernel (its packed tensors converted once
    and freed), or none of them: returns why not (logged); None when they run on it or the
    model has none."""
    from worker.models.quant.resident import Mxfp4Experts

    layers = [m for m in model.modules() if isinstance(m, Mxfp4Experts)]
    if not layers:
        return None
    why = unavailable(device, dtype)
    if why is not None:
        logger.info("MXFP4 experts: dequantized per expert when they run (%s)", why)
        return why
    from flashinfer.fused_moe import (
        cutlass_fused_moe,
        interleave_moe_scales_for_sm90_mixed_gemm,
        interleave_moe_weights_for_sm90_mixed_gemm,
    )

    for m in layers:
        layout = sm90_layout(
            m.gate_up_proj_blocks, m.gate_up_proj_scales, m.gate_up_proj_bias,
            m.down_proj_blocks, m.down_proj_scales, m.down_proj_bias, dtype,
        )  # fmt: skip
        layout = dataclasses.replace(
            layout,
            fc1=interleave_moe_weights_for_sm90_mixed_gemm(layout.fc1, "fp4"),
            fc2=interleave_moe_weights_for_sm90_mixed_gemm(layout.fc2, "fp4"),
            fc1_scales=interleave_moe_scales_for_sm90_mixed_gemm(layout.fc1_scales, SCALE_GROUP),
            fc2_scales=interleave_moe_scales_for_sm90_mixed_gemm(layout.fc2_scales, SCALE_GROUP),
        )
        m.use_fused(FusedMxfp4(layout, m.alpha, m.limit, cutlass_fused_moe))
    logger.info("MXFP4 experts: FlashInfer's fused SM90 MoE kernel (%d layers)", len(layers))
    return None
