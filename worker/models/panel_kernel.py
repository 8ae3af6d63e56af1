"""The small-step linear kernel (`csrc/linear.c`): float32 weights packed in 16-column panels,
multiplied by steps of a few rows (docs/design.md §19). Built once per machine by
`worker.native`; None without a C compiler or when the build fails (the packed oneDNN weight
then takes every step)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker import native

SOURCE = Path(__file__).with_name("csrc") / "linear.c"
SYMBOL = "swaserve_panel_linear_f32"
PANEL = 16  # output columns per panel (NR in the source)
_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.lru_cache(maxsize=1)
def panel_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel's ctypes function, or None (no compiler, or the build failed; logged once)."""
    fn = native.load(SOURCE, SYMBOL, "linear", "the packed weights take every step")
    if fn is not None:
        fn.argtypes = (_P, _I, _I, _P, _P, _I, _I, _P, _I)
        fn.restype = None
    return fn


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 → ``[ceil(out / 16), in, 16]``: panel j holds output columns
    16j..16j+15 k-major, the last one zero-padded."""
    out, inp = weight.shape
    n_panels = -(-out // PANEL)
    padded = weight.new_zeros(n_panels * PANEL, inp)
    padded[:out] = weight
    return padded.view(n_panels, PANEL, inp).transpose(1, 2).contiguous()


def pad_bias(bias: torch.Tensor | None, out: int) -> torch.Tensor | None:
    """The bias zero-padded to whole panels (the kernel adds 16 at a time)."""
    if bias is None:
        return None
    padded = bias.new_zeros(-(-out // PANEL) * PANEL)
    padded[:out] = bias
    return padded


def panel_linear(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    rows: torch.Tensor,  # [M, in] float32 (rows may be strided; the features contiguous)
    panels: torch.Tensor,  # `pack_panels` of the weight
    bias: torch.Tensor | None,  # `pad_bias` of the bias
    out_features: int,
) -> torch.Tensor:
    """``rows @ W.T (+ bias)`` as a new ``[M, out]`` tensor."""
    if rows.dtype != torch.float32:
        raise TypeError(f"the small-step kernel multiplies float32 rows, got {rows.dtype}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    y = rows.new_empty(m, out_features)
    fn(
        rows.data_ptr(), m, rows.stride(0), panels.data_ptr(),
        None if bias is None else bias.data_ptr(), out_features, k, y.data_ptr(), out_features,
    )  # fmt: skip
    return y


__all__ = ["panel_kernel", "pack_panels", "pad_bias", "panel_linear", "PANEL"]
