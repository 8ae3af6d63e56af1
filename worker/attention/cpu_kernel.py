"""The CPU attention kernel (`csrc/attention.c`): built once per machine, called through ctypes
(docs/design.md §21).

The torch backend's groups gather every key and value they read into a padded copy, then run
batched matmuls (or SDPA) and a softmax over the padding and the masked keys; on a CPU that is
bound by memory (the pool is read, the copy written and read again). The kernel reads each key
and value row from its slot, only those a query row may see (causal, windowed), in one call per
layer for the whole step. It is plain C, compiled by the system C compiler for this CPU
(``-O3 -march=native``) into a cache directory keyed by the source, the flags, the compiler and
the CPU, so a machine builds it once (about a second) and every process after loads it. The
cache directory is created 0700 and used only while it (and the kernel in it) belongs to this
user with no group/other write and is no symlink; otherwise the refusal is logged and the kernel
is built in a fresh private temporary directory: loading a planted shared object would run
someone else's code in the engine.

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
import stat
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


def kernel_name(cc: str) -> str:
    """The cached kernel's file name: keyed by the source, the flags, the compiler and the CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, version.stdout, _cpu_signature()]
        ).encode()
    ).hexdigest()[:20]
    return f"attention-{key}.so"


class UntrustedCacheError(OSError):
    """The kernel cache (or a kernel in it) could be written by someone else."""


def _untrusted(st: os.stat_result, kind: str) -> str:
    """Why a directory or file with this `lstat` may not be trusted ("" when it may)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not (stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)):
        return f"not a {kind}"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {stat.S_IMODE(st.st_mode):o}: others may write"
    return ""


def _private_cache() -> Path:
    """The cache directory, created 0700; UntrustedCacheError when it exists but is not ours
    alone (someone else could plant a kernel there), OSError when it cannot be made."""
    directory = cache_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    why = _untrusted(os.lstat(directory), "directory")
    if why:
        raise UntrustedCacheError(f"kernel cache {directory} is {why}")
    return directory


def _compile(cc: str, target: Path) -> Path:
    """Compile the kernel to `target`, atomically (processes may build it at once)."""
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


def _build(cc: str) -> Path:
    """The kernel in the private cache, compiled there unless a trusted one is already there.
    Raises OSError when the cache is unusable (UntrustedCacheError: not ours alone)."""
    target = _private_cache() / kernel_name(cc)
    if target.exists():
        why = _untrusted(os.lstat(target), "file")
        if not why:
            return target
        logger.warning("cached kernel %s is %s; building it again", target, why)
    return _compile(cc, target)


def _open(path: Path) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """Load the kernel at `path`, checked again on the file actually opened (no symlink, ours,
    not writable by others) so nothing swapped in after `_build` looked is loaded."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        why = _untrusted(os.fstat(fd), "file")
        if why:
            raise UntrustedCacheError(f"kernel {path} is {why}")
        by_fd = Path(f"/proc/self/fd/{fd}")
        return ctypes.CDLL(str(by_fd if by_fd.exists() else path))[SYMBOL]  # CDLL: calls release the GIL
    finally:
        os.close(fd)


def _load_built(cc: str) -> tuple[ctypes._CFuncPtr, str]:  # type: ignore[name-defined]
    """The kernel from the cache or, when the cache is unusable or not ours alone, built in a
    fresh private temporary directory (removed once loaded; never a shared fixed path)."""
    try:
        path = _build(cc)
        return _open(path), str(path)
    except UntrustedCacheError as exc:
        logger.warning("%s; refusing it and building the kernel in a private temporary directory", exc)
    except OSError as exc:  # a read-only home (a locked-down container)
        logger.info("kernel cache %s unusable (%s); building in a private temporary directory",
                    cache_dir(), exc)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="swaserve-kernel-") as tmp:  # mkdtemp: 0700, ours
        path = _compile(cc, Path(tmp) / kernel_name(cc))
        return _open(path), "a private temporary directory"


@functools.lru_cache(maxsize=1)
def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    cc = _compiler()
    if cc is None:
        logger.info("CPU attention kernel off: no C compiler (set CC); using torch ops")
        return None
    try:
        fn, where = _load_built(cc)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention kernel off (using torch ops): %s", exc)
        return None
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    logger.info("CPU attention kernel loaded from %s", where)
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
