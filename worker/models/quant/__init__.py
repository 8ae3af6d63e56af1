"""Quantized checkpoints: `quant_format(config)` picks the format `quantization_config` names
(docs/design.md §16); the loader dequantizes with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.errors import ConfigError
from worker.models.quant.base import Part, QuantFormat

SUPPORTED = {
    "fp8": "block-scaled e4m3 with weight_scale_inv, e.g. MiMo-V2-Flash",
    "mxfp4": "E2M1 blocks with E8M0 scales, GPT-OSS's experts",
}


def quant_format(config: Any) -> QuantFormat | None:
    """The format of a HF config's `quantization_config`; None for an unquantized checkpoint.

    Raises:
        ConfigError: the method is not one of `SUPPORTED`, or its settings are.
    """
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    settings: Mapping[str, Any] = raw if isinstance(raw, Mapping) else raw.to_dict()
    method = settings.get("quant_method")
    if method == "fp8":
        from worker.models.quant.fp8 import BlockFp8Format

        return BlockFp8Format.from_config(settings)
    if method == "mxfp4":
        from worker.models.quant.mxfp4 import Mxfp4Format

        return Mxfp4Format.from_config(settings)
    supported = "; ".join(f"{m} ({what})" for m, what in SUPPORTED.items())
    raise ConfigError(
        f"quantization_config.quant_method {method!r} is not supported; supported: {supported}. "
        "Use a checkpoint in one of these formats or an unquantized (bf16) one."
    )


__all__ = ["SUPPORTED", "Part", "QuantFormat", "quant_format"]
