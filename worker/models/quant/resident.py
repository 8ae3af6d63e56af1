"""Quantized weights kept in memory as stored (`quantized_weights: keep`, docs/design.md §16).

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
| block FP8 `self_attn.{q,k,v,o}_proj`, dense `mlp.*_proj` (MiMo-V2-Flash) | `Fp8Linear` | that linear's weight |

Under tensor parallelism the attention and dense-MLP FP8 linears (~2% of MiMo's bytes) are
dequantized at load as before: the sharder splits plain linears (docs/design.md §17.2).
`keep_quantized_modules` swaps the modules on the meta device, before anything is allocated, for
exactly the weights the checkpoint stores packed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.layers import GatedMLP
from worker.models.moe import GptOssExperts, MiMoMoE
from worker.models.opaque_ops import define_opaque_op
from worker.models.quant.base import QuantFormat
from worker.models.quant.fp8 import BlockFp8Format, dequantize_fp8_into
from worker.models.quant.mxfp4 import BLOCK, STEP_VALUES, Mxfp4Format, dequantize_mxfp4
from worker.models.self_attention import SelfAttention

# NOTE: per thread: engines in one process each step on their own forward thread.
_LOCAL = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reusable buffer of that shape, dtype and device (contents undefined).

    NOTE: one per inference mode too: a buffer made under `torch.inference_mode` (the engine's
    steps) is an inference tensor, which may not be written outside that mode."""
    bufs: dict[tuple[tuple[int, ...], torch.dtype, torch.device, bool], torch.Tensor]
    bufs = _LOCAL.__dict__.setdefault("bufs", {})
    key = (shape, dtype, device, torch.is_inference_mode_enabled())
    if key not in bufs:
        bufs[key] = torch.empty(shape, dtype=dtype, device=device)
    return bufs[key]


class Mxfp4Experts(GptOssExperts):
    """`GptOssExperts` whose two expert matrices stay MXFP4 (blocks of 32 along `in`)."""

    PACKED = ("gate_up_proj", "down_proj")
    fused: nn.Module | None  # the fused kernel's experts, once `use_fused` gave it them
    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor

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
        out.fused = None
        return out

    def weight_numel(self) -> int:
        """The packed matrices' weights (two per block byte; counted before `use_fused`)."""
        if self.fused is not None:
            return self.numel_before_fused
        return sum(2 * getattr(self, f"{n}_blocks").numel() for n in self.PACKED)

    def use_fused(self, fused: nn.Module) -> None:
        """Run on `fused` (`worker.models.quant.mxfp4_kernel`, which holds the experts in its own
        layout) from now on: the packed buffers are freed."""
        self.numel_before_fused = self.weight_numel()
        self.fused = fused
        for name in self.PACKED:
            for part in ("blocks", "scales"):
                t = getattr(self, f"{name}_{part}")
                self.register_buffer(f"{name}_{part}", t.new_empty(0))

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
    """A linear whose weight stays block-scaled e4m3 (`BlockFp8Format`); its bias, if any, is the
    original's parameter. Under `torch.compile` the product is the opaque ``swaserve::fp8_linear``
    op (found by index in a weak registry, as `PackedLinear` does): the per-thread scratch and the
    tile loop are not traced."""

    def __init__(self, linear: nn.Linear, block: tuple[int, int] | None) -> None:
        super().__init__()
        n, k = linear.weight.shape
        dev = linear.weight.device
        self.block = block
        self.dtype = linear.weight.dtype  # the compute dtype the weight is dequantized into
        self.out_features, self.in_features = n, k
        scales = (1,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        self.weight: torch.Tensor
        self.weight_scale_inv: torch.Tensor
        self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=dev))
        self.register_buffer("weight_scale_inv", torch.empty(scales, dtype=torch.float32, device=dev))
        self.bias = linear.bias
        # FlashInfer's blockwise FP8 GEMM where `quant.fp8_kernel.use_fp8_kernels` found it usable
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.index = len(_FP8_REGISTRY)
        _FP8_REGISTRY.append(weakref.ref(self))

    def weight_numel(self) -> int:
        return self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.swaserve.fp8_linear(x, self.index, self.out_features)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``: through the kernel, or with `W` dequantized into this thread's scratch
        (a fresh result either way)."""
        if self.kernel is not None:
            from worker.models.quant.fp8_kernel import call_kernel

            rows = x.reshape(-1, self.in_features).contiguous()
            y = call_kernel(self.kernel, rows, self.weight, self.weight_scale_inv)
            y = y if self.bias is None else y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        w = scratch((self.out_features, self.in_features), self.dtype, self.weight.device)
        dequantize_fp8_into(w, self.weight, self.weight_scale_inv, self.block)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


# Every Fp8Linear of the process, by index, for the opaque op (weak: a freed model frees them).
_FP8_REGISTRY: list[weakref.ref[Fp8Linear]] = []


def _fp8_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    module = _FP8_REGISTRY[index]()
    assert module is not None, f"fp8 linear {index} was freed"
    return module.product(x)


def _fp8_linear_fake(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


define_opaque_op("fp8_linear", "(Tensor x, int index, int out_features) -> Tensor",
                 _fp8_linear, _fp8_linear_fake)  # fmt: skip


def keep_quantized_modules(
    model: nn.Module, quant: QuantFormat, targets: Collection[str], *, dense: bool = True
) -> int:
    """Swap, on the meta device, every module whose weights the checkpoint stores packed
    (`targets`: the quantized parameters' names) for its packed form: GPT-OSS's MXFP4 experts,
    MiMo's FP8 expert linears and, with `dense`, the FP8 linears of attention and dense MLPs
    (not under tensor parallelism: its sharder splits plain linears only). Returns how many."""
    swapped = 0
    experts = {id(m) for b in model.modules() if isinstance(b, MiMoMoE) for m in b.experts}
    for name, module in list(model.named_modules()):
        if isinstance(module, GptOssExperts) and isinstance(quant, Mxfp4Format):
            if all(f"{name}.{p}" in targets for p in Mxfp4Experts.PACKED):
                _replace(model, name, Mxfp4Experts.from_experts(module))
                swapped += 1
        elif isinstance(module, (GatedMLP, SelfAttention)) and isinstance(quant, BlockFp8Format):
            if not dense and id(module) not in experts:
                continue
            for proj, linear in list(module.named_children()):
                if type(linear) is nn.Linear and f"{name}.{proj}.weight" in targets:
                    setattr(module, proj, Fp8Linear(linear, quant.block))
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
