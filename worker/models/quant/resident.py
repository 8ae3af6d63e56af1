"""Quantized experts kept in memory as stored (`quantized_weights: keep`, docs/design.md §16).

A mixture of experts' expert weights are ~98% of GPT-OSS's and MiMo-V2-Flash's bytes. With
`keep` they stay packed, as the checkpoint stores them, and each expert that receives tokens is
dequantized when it runs into a scratch buffer (one per thread, shape and dtype: one expert's
matrix at a time), with the float32 arithmetic and the single cast of the load-time path, so
both paths multiply identical values. This is the reference path (the CPU's, and CUDA's until
kernels that read the packed form are wired in).

| stored | kept in | dequantized per call |
| --- | --- | --- |
| MXFP4 `mlp.experts.{gate_up,down}_proj` (GPT-OSS) | `Mxfp4Experts`: uint8 `*_blocks`, `*_scales` | the routed expert's matrix |
| block FP8 `mlp.experts.N.{gate,up,down}_proj` (MiMo-V2-Flash) | `Fp8Linear`: e4m3 `weight`, float32 `weight_scale_inv` | that linear's weight |

What else a checkpoint quantizes (MiMo's attention and dense-MLP FP8 linears, ~2% of its
bytes) is dequantized at load as before. `keep_experts_quantized` swaps the modules on the meta
device, before anything is allocated, for exactly the experts the checkpoint stores packed.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.moe import GptOssExperts, MiMoMoE
from worker.models.quant.base import QuantFormat
from worker.models.quant.fp8 import BlockFp8Format, dequantize_fp8_into
from worker.models.quant.mxfp4 import BLOCK, STEP_VALUES, Mxfp4Format, dequantize_mxfp4

# NOTE: per thread: engines in one process each step on their own forward thread.
_LOCAL = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reusable buffer of that shape, dtype and device (contents undefined)."""
    bufs: dict[tuple[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
    bufs = _LOCAL.__dict__.setdefault("bufs", {})
    key = (shape, dtype, device)
    if key not in bufs:
        bufs[key] = torch.empty(shape, dtype=dtype, device=device)
    return bufs[key]


class Mxfp4Experts(GptOssExperts):
    """`GptOssExperts` whose two expert matrices stay MXFP4 (blocks of 32 along `in`)."""

    PACKED = ("gate_up_proj", "down_proj")

    @classmethod
    def from_experts(cls, experts: GptOssExperts) -> Mxfp4Experts:
        """The same experts (biases shared), their matrices as packed buffers (on meta)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.alpha, out.limit = experts.alpha, experts.limit
        out.gate_up_proj_bias, out.down_proj_bias = experts.gate_up_proj_bias, experts.down_proj_bias
        for name in cls.PACKED:
            e, n_in, n_out = getattr(experts, name).shape
            dev = getattr(experts, name).device
            out.register_buffer(f"{name}_blocks", torch.empty(e, n_out, n_in // BLOCK, BLOCK // 2, dtype=torch.uint8, device=dev))
            out.register_buffer(f"{name}_scales", torch.empty(e, n_out, n_in // BLOCK, dtype=torch.uint8, device=dev))
        return out

    def weight_numel(self) -> int:
        """The packed matrices' weights (two per block byte)."""
        return sum(2 * getattr(self, f"{n}_blocks").numel() for n in self.PACKED)

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        blocks, scales = getattr(self, f"{name}_blocks")[e], getattr(self, f"{name}_scales")[e]
        n_out, groups = scales.shape
        n_in = groups * BLOCK
        dst = scratch((n_in, n_out), dtype, blocks.device)
        step = max(1, STEP_VALUES // n_in)  # a few rows at a time: small float32 temporaries
        for r in range(0, n_out, step):
            dst[:, r : r + step].copy_(dequantize_mxfp4(blocks[r : r + step], scales[r : r + step]).transpose(0, 1))
        return dst


class Fp8Linear(nn.Module):
    """A bias-free linear whose weight stays block-scaled e4m3 (`BlockFp8Format`)."""

    def __init__(self, linear: nn.Linear, block: tuple[int, int] | None) -> None:
        super().__init__()
        n, k = linear.weight.shape
        dev = linear.weight.device
        self.block = block
        self.dtype = linear.weight.dtype  # the compute dtype the weight is dequantized into
        scales = (1,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        self.weight: torch.Tensor
        self.weight_scale_inv: torch.Tensor
        self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev))
        self.register_buffer("weight_scale_inv", torch.empty(scales, dtype=torch.float32, device=dev))

    def weight_numel(self) -> int:
        return self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = scratch(tuple(self.weight.shape), self.dtype, self.weight.device)
        dequantize_fp8_into(w, self.weight, self.weight_scale_inv, self.block)
        return F.linear(x, w)


def keep_experts_quantized(model: nn.Module, quant: QuantFormat, targets: Collection[str]) -> int:
    """Swap, on the meta device, every expert module whose matrices the checkpoint stores packed
    (`targets`: the quantized parameters' names) for its packed form. Returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, GptOssExperts) and isinstance(quant, Mxfp4Format):
            if all(f"{name}.{p}" in targets for p in Mxfp4Experts.PACKED):
                _replace(model, name, Mxfp4Experts.from_experts(module))
                swapped += 1
        elif isinstance(module, MiMoMoE) and isinstance(quant, BlockFp8Format):
            for i, expert in enumerate(module.experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    linear = getattr(expert, proj, None)
                    if isinstance(linear, nn.Linear) and f"{name}.experts.{i}.{proj}.weight" in targets:
                        setattr(expert, proj, Fp8Linear(linear, quant.block))
                        swapped += 1
    return swapped


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def stored_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take where they live: parameters and buffers as stored (packed
    experts count their packed bytes), each tensor once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())
