"""Block-scaled FP8 (`quant_method: fp8`): MiMo-V2-Flash's (and DeepSeek-V3's) checkpoints.

A linear weight ``X.weight`` of shape ``[..., N, K]`` is stored as e4m3 values of the same
shape plus ``X.weight_scale_inv``, one float32 multiplier per ``weight_block_size = [bn, bk]``
tile, ``[..., ceil(N / bn), ceil(K / bk)]`` (edge tiles are partial); the value is
``weight * weight_scale_inv`` of its tile. Without a block size the scale is one per tensor.
Scales stored as E8M0 (``scale_fmt: ue8m0``: uint8 or ``float8_e8m0fnu``) are ``2 ** (s - 127)``.
Products are taken in float32, then cast (docs/design.md §16).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from worker.errors import ConfigError
from worker.models.quant.base import QuantFormat, check_shape

E8M0_BIAS = 127


def _scales_f32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)
    return scale.to(torch.float32)


class BlockFp8Format(QuantFormat):
    method = "fp8"
    parts = {"weight": "", "scale_inv": "_scale_inv"}
    marker = "scale_inv"

    def __init__(
        self, modules_to_not_convert: Sequence[str] = (), block: tuple[int, int] | None = None
    ) -> None:
        super().__init__(modules_to_not_convert)
        self.block = block

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BlockFp8Format:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(
                f"fp8 activation_scheme {scheme!r} is not supported (static activation scales); "
                "supported: 'dynamic'"
            )
        size = config.get("weight_block_size")
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise ConfigError(f"fp8 weight_block_size {size!r} must be [rows, cols], both >= 1")
        block = None if size is None else (int(size[0]), int(size[1]))
        return cls(config.get("modules_to_not_convert") or (), block)

    def as_kept(self, role: str, stored: torch.Tensor) -> torch.Tensor:
        """Scales are kept as float32 multipliers (E8M0 bytes decoded once, at load)."""
        return _scales_f32(stored) if role == "scale_inv" else stored

    def dequantize_into(self, dst: torch.Tensor, parts: dict[str, torch.Tensor], name: str) -> None:
        weight = parts["weight"].to(dst.device)
        scale = _scales_f32(parts["scale_inv"]).to(dst.device)
        if weight.element_size() != 1 or not weight.dtype.is_floating_point:
            raise ValueError(f"{name}: fp8 weight stored as {weight.dtype}, not a float8 type")
        check_shape(name, weight.shape, dst.shape, "fp8 weight shape")
        if self.block is None:
            check_shape(name, (scale.numel(),), (1,), "per-tensor fp8 scale count")
        else:
            (bn, bk), (*lead, n, k) = self.block, weight.shape
            want = (*lead, -(-n // bn), -(-k // bk))
            check_shape(name, scale.shape, want, "fp8 weight_scale_inv shape")
        dequantize_fp8_into(dst, weight, scale, self.block)


def dequantize_fp8_into(
    dst: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> None:
    """``weight * scale`` of its tile, in float32, cast once into `dst` (shapes checked by the
    caller; `scale` float32 on `dst`'s device). Shared by the load-time path and `Fp8Linear`."""
    if block is None:
        dst.copy_(weight.float() * scale.reshape(()))
        return
    (bn, bk), (*_, n, k) = block, weight.shape
    rows = -(-n // bn)
    # On the host one tile row per step keeps the float32 temporaries to bn rows; on an
    # accelerator the whole weight at once (docs/design.md §16).
    tiles = 1 if dst.device.type == "cpu" else rows
    for i in range(0, rows, tiles):
        r0, r1 = i * bn, min(n, (i + tiles) * bn)
        s = scale[..., i : i + tiles, :].repeat_interleave(bn, dim=-2)[..., : r1 - r0, :]
        s = s.repeat_interleave(bk, dim=-1)[..., :k]
        dst[..., r0:r1, :].copy_(weight[..., r0:r1, :].float() * s)
