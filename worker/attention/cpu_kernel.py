"""The CPU attention kernel (`csrc/attention.c`): built once per machine, called through ctypes
(docs/design.md §21).

The torch backend's groups gather every key and value they read into a padded copy, then run
batched matmuls (or SDPA) and a softmax over the padding and the masked keys; on a CPU that is
bound by memory (the pool is read, the copy written and read again). The kernel reads each key
and value row from its slot, only those a query row may see (causal, windowed), in one call per
layer for the whole step. It is plain C, built once per machine by `worker.native` (cache, trust
rules, fallbacks there).

Without a C compiler, or when the build fails, `attention_kernel` returns None once (logged) and
the torch backend keeps its gather path: the kernel is a speed-up, never a requirement.
``SWASERVE_CPU_KERNEL=0`` turns it off (A/B runs; a suspect kernel).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from worker import native

SOURCE = Path(__file__).with_name("csrc") / "attention.c"
SYMBOL = "swaserve_attention_f32"
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_ARGTYPES = (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _F, _P, _P, _I)


def enabled() -> bool:
    """False when ``SWASERVE_CPU_KERNEL`` is 0/false/off (read at each call: tests flip it)."""
    return os.environ.get("SWASERVE_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "off")


@functools.lru_cache(maxsize=1)
def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    fn = native.load(SOURCE, SYMBOL, "attention", "using torch ops")
    if fn is not None:
        fn.argtypes = _ARGTYPES
        fn.restype = ctypes.c_int
    return fn


def attention_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel's ctypes function, or None (off, no compiler, or the build failed)."""
    return _load() if enabled() else None


def attention(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    q: torch.Tensor,  # [T, hq, d] float32, heads contiguous (rows may be strided)
    k_buf: torch.Tensor,  # [slots, hkv, d] float32, contiguous
    v_buf: torch.Tensor,  # [slots, hkv, dv] float32, contiguous
    slots: torch.Tensor,  # int64, contiguous: the key slots the rows index into
    start: torch.Tensor,  # int64 [T]: row r reads slots[start[r] : start[r] + count[r]]
    count: torch.Tensor,  # int64 [T], each >= 1
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # float32 [hq] contiguous
    out: torch.Tensor,  # [T, hq, dv] float32, heads contiguous
) -> None:
    """Every query row's attention into `out` (the caller checked dtypes and layouts)."""
    T, hq, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    rc = fn(
        q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(),
        start.data_ptr(), count.data_ptr(), T, hq, hkv, d, dv, scale,
        0.0 if softcap is None else softcap, 0 if sinks is None else sinks.data_ptr(),
        out.data_ptr(), out.stride(0),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("CPU attention kernel could not allocate its scratch memory")


__all__ = ["attention_kernel", "attention", "enabled"]
