"""The CPU attention kernel (`csrc/attention.c`): built once per machine, called through ctypes
(docs/design.md §21).

The torch backend's groups gather every key and value they read into a padded copy, then run
batched matmuls (or SDPA) and a softmax over the padding and the masked keys; on a CPU that is
bound by memory (the pool is read, the copy written and read again). The kernel reads each key
and value row from its slot, only those a query row may see (causal, windowed), in one call per
layer for the whole step. It is plain C, compiled by the system C compiler for this CPU
(``-O3 -march=native``) into a cache directory keyed by the source, the flags, the compiler and
the CPU, so a machine builds it once (about a second) and every process after loads it.

Without a C compiler, or when the build fails, `attention_kernel` returns None once (logged) and
the torch backend keeps its gather path: the kernel is a speed-up, never a requirement.
``SWASERVE_CPU_KERNEL=0`` turns it off (A/B runs; a suspect kernel); ``SWASERVE_KERNEL_CACHE``
moves the cache (default ``$XDG_CACHE_HOME/swaserve/kernels`` or ``~/.cache/swaserve/kernels``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "attention.c"
SYMBOL = "swaserve_attention_f32"
# NOTE: -ffast-math at compile time only (it lets GCC call glibc's vector expf); linking a
# shared object with it would add crtfastmath.o, which sets flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp-simd", "-ffast-math")
LINK_FLAGS = ("-shared", "-lm")
BUILD_TIMEOUT_S = 120

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_ARGTYPES = (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _F, _P, _P, _I)


def enabled() -> bool:
    """False when ``SWASERVE_CPU_KERNEL`` is 0/false/off (read at each call: tests flip it)."""
    return os.environ.get("SWASERVE_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "off")


def cache_dir() -> Path:
    env = os.environ.get("SWASERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "swaserve" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _build(cc: str) -> Path:
    """Compile the kernel into the cache (atomically: processes may build it at once)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, version.stdout, _cpu_signature()]
        ).encode()
    ).hexdigest()[:20]
    target = cache_dir() / f"attention-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):
            raise PermissionError(f"{target.parent} is not writable")
    except OSError as exc:  # a read-only home (a locked-down container): the temp dir instead
        fallback = Path(tempfile.gettempdir()) / "swaserve-kernels" / target.name
        logger.info("kernel cache %s unusable (%s); building into %s", target.parent, exc,
                    fallback.parent)  # fmt: skip
        target = fallback
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in (
            [cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [cc, str(obj), *LINK_FLAGS, "-o", str(lib)],
        ):
            res = subprocess.run(
                cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if res.returncode != 0:
                raise RuntimeError(f"`{shlex.join(cmd)}` failed: {res.stderr.strip()[-2000:]}")
        os.replace(lib, target)
    return target


@functools.lru_cache(maxsize=1)
def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    cc = _compiler()
    if cc is None:
        logger.info("CPU attention kernel off: no C compiler (set CC); using torch ops")
        return None
    try:
        path = _build(cc)
        fn = ctypes.CDLL(str(path))[SYMBOL]  # CDLL: the call releases the GIL
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernel off (using torch ops): %s", exc)
        return None
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    logger.info("CPU attention kernel loaded from %s", path)
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


__all__ = ["attention_kernel", "attention", "enabled", "cache_dir"]
