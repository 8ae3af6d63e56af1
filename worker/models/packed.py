"""Linear layers with oneDNN-packed weights for CPU (docs/design.md §19).

`F.linear` on a CPU hands an unpacked row-major weight to MKL's GEMM on every call; at decode
sizes (a few rows) the repacking inside the GEMM costs more than the product. oneDNN can reorder
the weight once into its blocked layout (`mkldnn._reorder_linear_weight`) and then multiply any
number of rows against it (`mkldnn._linear_pointwise`), which is what inductor's freezing and
vLLM's CPU backend do. `pack_linears` does it once at load for every dense linear of a model:
attention projections, MLPs, MoE experts that are plain `nn.Linear`s, the LM head, and their
tensor-parallel shards. Linears that read the same input are packed as one first
(`fuse_linears`: a module names them in `FUSED_LINEARS`; q/k/v of attention, gate/up of a gated
MLP): one oneDNN call instead of two or three, and the small k/v projections of grouped-query
attention, too small to pack alone, ride on q's.

The packed weight is an opaque oneDNN tensor (layout `torch._mkldnn`): it is kept as a plain
attribute, not a parameter, so `state_dict` no longer lists it and the unpacked copy is freed
(a tied LM head packs its own copy; the embedding keeps the original).

Few rows are the exception: oneDNN's blocked layout reads the weight slower than a step of a
few rows needs (a decode step at concurrency 1-8 reads every weight once for one to eight
rows). With ``panel_copies`` (`EngineConfig` ``small_step_kernel``) a float32 `PackedLinear`
also keeps its weight in 16-column panels and multiplies steps of few rows with the C kernel
`worker.models.panel_kernel` (`PANEL_ROWS_MAX` rows on one torch thread, `PANEL_ROWS_MAX_THREADED`
on more: the kernel runs on the calling thread), at the price of the linear weights' memory
once more.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from worker.models.opaque_ops import define_opaque_op
from worker.models.panel_kernel import pack_panels, pad_bias, panel_kernel, panel_linear

logger = logging.getLogger(__name__)

# Smallest weight (in x out elements) worth packing. oneDNN's packed call has a fixed cost of
# tens of microseconds on one thread; below ~512 x 512 plain `F.linear` is as fast or faster at
# decode sizes, and a hidden-128 model ran 0.7x packed (measured: docs/design.md §19).
PACK_MIN_ELEMENTS = 1 << 18

# A step of at most this many rows multiplies on the panel copy when a `PackedLinear` keeps one.
# `swaserve bench linears` (one thread, the 46M Gemma-3's linears, docs/design.md §19): panels
# 0.58-0.76x the packed weight's time at 1-16 rows, 0.96-0.97x at 32-64, level at 128-256.
PANEL_ROWS_MAX = 64
# With more torch threads oneDNN splits the product while the kernel runs on one: on two threads
# the packed weight is level at 6 rows and wins from 8 (21.3 against 25.5 ms), so only one tile
# of rows (the weight read once) takes the kernel.
PANEL_ROWS_MAX_THREADED = 6
# `small_step_kernel: auto` keeps the panel copies (float32 models) when they fit in this share
# of the memory available at load.
PANEL_COPY_MEMORY_SHARE = 0.25


# Every PackedLinear of the process, by index, for the opaque op below (weak: a model that is
# freed frees its packed weights).
_REGISTRY: list[weakref.ref[PackedLinear]] = []


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with `W` reordered once for oneDNN. Inputs of any leading shape.
    With `panel_copy` (float32), also `W` in the small-step kernel's panels, for steps of few
    rows (`panel_rows_max`)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, panel_copy: bool = False
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if panel_copy and weight.dtype != torch.float32:
            raise ValueError(f"panel copies are float32 only (the small-step kernel), not {weight.dtype}")
        kernel = panel_kernel() if panel_copy else None
        with torch.no_grad():
            # CPU, dtype float32/bfloat16/float16 (opaque oneDNN layout)
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            self.bias = None if bias is None else bias.detach().clone()
            # plain attributes, as `packed`: not parameters, not in `state_dict`
            self.kernel = kernel
            self.panels = pack_panels(weight.detach()) if kernel is not None else None
            self.panel_bias = pad_bias(self.bias, self.out_features) if kernel is not None else None
        self.index = len(_REGISTRY)
        _REGISTRY.append(weakref.ref(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if torch.compiler.is_compiling():
            # NOTE: under torch.compile the oneDNN weight cannot be a graph constant (inductor's
            # lowering rejects its layout): the product is one opaque op, the code around it fused.
            y = torch.ops.swaserve.packed_linear(rows, self.index, self.out_features)
        else:
            y = self.product(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and rows.shape[0] <= panel_rows_max():
            return panel_linear(self.kernel, rows, self.panels, self.panel_bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        panels = ", panel copy for small steps" if self.panels is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed{panels}"


def panel_rows_max() -> int:
    """The most rows a step multiplies on the panel copies, for this thread count (read at each
    call: an engine sets its threads before the first step)."""
    return PANEL_ROWS_MAX if torch.get_num_threads() == 1 else PANEL_ROWS_MAX_THREADED


def _packed_linear(rows: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """`PackedLinear.product` of the packed linear number `index` (``rows [n, in]``)."""
    module = _REGISTRY[index]()
    assert module is not None, f"packed linear {index} was freed"
    return module.product(rows)


def _packed_linear_fake(rows: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


define_opaque_op("packed_linear", "(Tensor rows, int index, int out_features) -> Tensor",
                 _packed_linear, _packed_linear_fake)  # fmt: skip


class PackedSplitLinear(nn.Module):
    """Linears of one input packed as one: ``x @ [W1; W2; ...].T``, split back into each
    linear's output (views of one result: no copy)."""

    def __init__(self, linears: list[nn.Linear], panel_copy: bool = False) -> None:
        super().__init__()
        biases = [lin.bias for lin in linears]
        assert all(b is None for b in biases) or all(b is not None for b in biases)
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.sizes = [lin.out_features for lin in linears]
        self.inner = PackedLinear(weight, bias, panel_copy)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.inner(x).split(self.sizes, dim=-1))

    def extra_repr(self) -> str:
        return f"in_features={self.inner.in_features}, outputs={self.sizes}, oneDNN-packed"


@dataclass(frozen=True)
class PackReport:
    """What `pack_linears` did: how many layers it packed, or why it packed none."""

    packed: int
    skipped_reason: str | None = None
    fused: int = 0  # groups of linears packed as one (each group counts once in `packed`)
    panel_copy_bytes: int = 0  # the panel copies kept beside the packed weights (0: none)


def packing_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this torch build cannot pack weights of `dtype` on `device`; None when it can."""
    if device.type != "cpu":
        return f"weight packing is a CPU path (device {device.type})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN reports no bfloat16 support on this CPU"
    if dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return "oneDNN reports no float16 support on this CPU"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"no oneDNN packed linear for {dtype}"
    return None


def pack_linears(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    min_elements: int | None = None,
    panel_copies: str = "off",
) -> PackReport:
    """Replace every packable linear of `model` in place (once, after the weights are loaded).

    A module is packable when it is an `nn.Linear` whose weight has the compute dtype, or defines
    ``packed(panel_copy) -> nn.Module`` (the tensor-parallel layers: the local matmul packed, the
    all-reduce kept), and its weight has at least `min_elements` entries (default
    `PACK_MIN_ELEMENTS`, read at call time). Weights kept in float32 by a lower-precision model
    (MoE routers) stay eager. `panel_copies` ("auto", "on", "off": `small_step_kernel`) says
    whether each packed weight also keeps its panel copy for small steps
    (`keeps_panel_copies`, and the kernel must build).
    """
    least = PACK_MIN_ELEMENTS if min_elements is None else min_elements
    reason = packing_unsupported(device, dtype)
    if reason is not None:
        logger.info("linear weights left unpacked: %s", reason)
        return PackReport(0, reason)
    copy_bytes = packable_bytes(model, dtype, least)
    threads = torch.get_num_threads()
    panels = keeps_panel_copies(panel_copies, dtype, copy_bytes, available_memory(), threads)
    no_panels = f"none (small_step_kernel {panel_copies}, {dtype}, {threads} torch threads)"
    if panels and panel_kernel() is None:
        panels, no_panels = False, "none (the kernel did not build: see above)"
    fused = fuse_linears(model, dtype, least, panels)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child, dtype, least)
    ]
    for parent, name, child in targets:
        setattr(parent, name, _packed(child, panels))
    logger.info(
        "packed %d linear weights for oneDNN, %d of them fused groups (%s; smaller than %d "
        "entries: eager); panel copies for steps of <= %d rows (<= %d on more threads): %s",
        len(targets) + fused, fused, dtype, least, PANEL_ROWS_MAX, PANEL_ROWS_MAX_THREADED,
        f"{copy_bytes / 1e6:.1f} MB" if panels else no_panels,
    )  # fmt: skip
    return PackReport(len(targets) + fused, fused=fused, panel_copy_bytes=copy_bytes if panels else 0)


def keeps_panel_copies(
    mode: str, dtype: torch.dtype, copy_bytes: int, available: int, threads: int = 1
) -> bool:
    """`small_step_kernel`'s decision (the kernel is float32 only): "off" never; "on" for a
    float32 model; "auto" for a float32 model on one torch thread (the measured case: on more,
    oneDNN splits the product the kernel runs on one thread) whose copies' `copy_bytes` fit in
    `PANEL_COPY_MEMORY_SHARE` of `available`."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"small_step_kernel must be auto, on or off, got {mode!r}")
    if mode == "off" or dtype != torch.float32:
        return False
    return mode == "on" or (threads == 1 and copy_bytes <= PANEL_COPY_MEMORY_SHARE * available)


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``: free memory plus
    what the page cache would give back; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def packable_bytes(model: nn.Module, dtype: torch.dtype, least: int) -> int:
    """Bytes of the weights `pack_linears` would pack (read before it packs them): each
    fusable group's members and every other packable module."""
    grouped: set[int] = set()
    for module in model.modules():
        for _fused_name, names in getattr(module, "FUSED_LINEARS", ()):
            members = [getattr(module, n, None) for n in names]
            if _fusable(members, dtype, least):
                grouped.update(id(m) for m in members)
    total = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and (id(module) in grouped or _packable(module, dtype, least)):
            total += w.numel() * w.element_size()
    return total


def fuse_linears(model: nn.Module, dtype: torch.dtype, least: int, panel_copy: bool = False) -> int:
    """Pack each group a module lists in ``FUSED_LINEARS`` (``(fused name, (member names))``)
    as one `PackedSplitLinear` under the fused name; the members become None. A group fuses
    when every member is a plain `nn.Linear` of the compute dtype on the CPU (not a
    tensor-parallel shard), they share the input size and either all or none have a bias, and
    together they reach `least` entries. Returns how many groups were fused."""
    count = 0
    for module in model.modules():
        for fused_name, names in getattr(module, "FUSED_LINEARS", ()):
            members = [getattr(module, n, None) for n in names]
            if not _fusable(members, dtype, least):
                continue
            setattr(module, fused_name, PackedSplitLinear(members, panel_copy))  # type: ignore[arg-type]
            for n in names:
                setattr(module, n, None)
            count += 1
    return count


def _fusable(members: list[object], dtype: torch.dtype, least: int) -> bool:
    if not all(type(m) is nn.Linear for m in members):
        return False
    linears: list[nn.Linear] = members  # type: ignore[assignment]
    return (
        all(m.weight.dtype == dtype and m.weight.device.type == "cpu" for m in linears)
        and len({m.in_features for m in linears}) == 1
        and len({m.bias is None for m in linears}) == 1
        and sum(m.weight.numel() for m in linears) >= least
    )


def _packable(module: nn.Module, dtype: torch.dtype, least: int) -> bool:
    if not isinstance(module, nn.Linear) and not callable(getattr(module, "packed", None)):
        return False
    w = getattr(module, "weight", None)
    return (
        isinstance(w, torch.Tensor)
        and w.dtype == dtype
        and w.device.type == "cpu"
        and w.numel() >= least
    )


def _packed(module: nn.Module, panel_copy: bool) -> nn.Module:
    if isinstance(module, nn.Linear):
        return PackedLinear(module.weight, module.bias, panel_copy)
    replacement = module.packed(panel_copy)  # type: ignore[operator]
    assert isinstance(replacement, nn.Module), f"{type(module).__name__}.packed()"
    return replacement
