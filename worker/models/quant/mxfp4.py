"""MXFP4 (`quant_method: mxfp4`): GPT-OSS's expert tensors, as its checkpoints store them.

A parameter ``X`` of shape ``[experts, in, out]`` is stored as

    X_blocks  uint8 [experts, out, in / 32, 16]   two E2M1 codes per byte, low nibble first
    X_scales  uint8 [experts, out, in / 32]       one E8M0 exponent per 32 values, bias 127

so value ``j`` of a 32-value block is ``FP4_VALUES[code_j] * 2 ** (scale - 127)``, and the
blocks run along ``in`` (the checkpoint holds each expert transposed, ``[out, in]``).
Dequantization is exact in float32 and bfloat16 (docs/design.md §16).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worker.models.quant.base import QuantFormat, check_shape

# E2M1 code → value: sign bit 3, exponent bits 2..1, mantissa bit 0.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = _MAGNITUDES + tuple(-v for v in _MAGNITUDES)
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0: 2 ** (byte - 127)
STEP_VALUES = 1 << 18  # values per host step: ~1 MiB of float32 temporaries


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., G, 16]`` uint8 codes and ``[..., G]`` uint8 exponents → ``[..., G * 32]`` float32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)
    exponent = scales.to(torch.int32).sub_(SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exponent).flatten(-2)


class Mxfp4Format(QuantFormat):
    method = "mxfp4"
    parts = {"blocks": "_blocks", "scales": "_scales"}
    marker = "blocks"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Mxfp4Format:
        return cls(config.get("modules_to_not_convert") or ())

    def dequantize_into(self, dst: torch.Tensor, parts: dict[str, torch.Tensor], name: str) -> None:
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4:
            raise ValueError(
                f"{name}: MXFP4 expects uint8 blocks [experts, out, in/32, 16] and uint8 scales, "
                f"got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype}"
            )
        experts, out, groups, nbytes = blocks.shape
        check_shape(name, scales.shape, (experts, out, groups), "MXFP4 scales shape")
        check_shape(name, (experts, groups * 2 * nbytes, out), dst.shape, "MXFP4 blocks encode")
        # On the host, a few rows of one expert per step keep the temporaries ~STEP_VALUES floats
        # however large the tensor; on an accelerator, one expert per step (docs/design.md §16).
        blocks, scales = blocks.to(dst.device), scales.to(dst.device)
        step = max(1, STEP_VALUES // (groups * 2 * nbytes)) if dst.device.type == "cpu" else out
        for e in range(experts):
            for r in range(0, out, step):
                value = dequantize_mxfp4(blocks[e, r : r + step], scales[e, r : r + step])
                dst[e, :, r : r + step].copy_(value.transpose(0, 1))
