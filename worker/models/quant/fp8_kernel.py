"""Block-FP8 linears through FlashInfer's blockwise-scaled GEMM on SM90 (docs/design.md §16).

FlashInfer 0.7.4's `flashinfer.gemm.fp8_blockscale_gemm_sm90(input, weight, input_scale,
weight_scale, out=None, out_dtype=None)` multiplies a bf16 ``[M, K]`` input (quantized inside,
1 x 128 groups) by an e4m3 ``[N, K]`` weight with float32 ``[ceil(N / 128), K / 128]`` scales
(128 x 128 blocks): exactly what `Fp8Linear` holds for MiMo-V2-Flash (`weight`,
`weight_scale_inv`), with no conversion. Its own checks, read from its source: SM90 only, K a
multiple of 128, N of 64, float32 scales. Because it quantizes the activations, its products
differ from the dequantized weight's by FP8 rounding of the input (the `activation_scheme:
dynamic` the checkpoint declares); `bench/gpu_check.py` compares the two on a GPU.

NOTE: nothing here has run on a GPU. A linear takes the kernel only where `unavailable` finds
nothing missing; otherwise it dequantizes its weight per call, and the reason is logged.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker.models.quant.base import sm90_unavailable

logger = logging.getLogger(__name__)

BLOCK = (128, 128)


def binds(fn: Callable[..., Any]) -> str | None:
    """None when `fn`'s signature accepts the call `Fp8Linear` makes (`call_kernel`)."""
    meta = torch.empty(1, 1, device="meta")
    try:
        inspect.signature(fn).bind(meta, meta, None, meta, out_dtype=torch.bfloat16)
    except TypeError as exc:
        return f"{getattr(fn, '__qualname__', fn)} does not take the call: {exc}"
    return None


def call_kernel(
    kernel: Callable[..., torch.Tensor], rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``rows [M, K] @ weight.T`` through the kernel (bf16 input, no input scale)."""
    return kernel(rows, weight, None, scale, out_dtype=rows.dtype)


def device_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why no linear can take the kernel on `device` in `dtype`; None when some can."""
    reason = sm90_unavailable(device, dtype, "the SM90 blockwise FP8 GEMM")
    if reason is not None:
        return reason
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except ImportError as exc:
        return f"flashinfer.gemm does not import ({exc})"
    return binds(fp8_blockscale_gemm_sm90)


def shape_unavailable(block: tuple[int, int] | None, n: int, k: int) -> str | None:
    """Why a linear of this block and shape cannot take the kernel; None when it can."""
    if block != BLOCK:
        return f"weight_block_size {block} is not [128, 128]"
    if k % 128 or n % 64:
        return f"in {k} is not a multiple of 128 or out {n} of 64"
    return None


def use_fp8_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Give every `Fp8Linear` of `model` whose shape the kernel takes the kernel; returns why
    none can (logged), None when the device can (each refused shape is logged with its count)."""
    from worker.models.quant.resident import Fp8Linear

    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not linears:
        return None
    why = device_unavailable(device, dtype)
    if why is not None:
        logger.info("FP8 linears: dequantized per call (%s)", why)
        return why
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    refused: Counter[str] = Counter()
    for m in linears:
        reason = shape_unavailable(m.block, m.out_features, m.in_features)
        if reason is None:
            m.kernel = fp8_blockscale_gemm_sm90
        else:
            refused[reason] += 1
    logger.info("FP8 linears: %d on FlashInfer's blockwise GEMM", len(linears) - sum(refused.values()))
    for reason, count in refused.items():
        logger.info("FP8 linears: %d dequantized per call (%s)", count, reason)
    return None
