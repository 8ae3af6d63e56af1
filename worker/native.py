"""C kernels built once per machine and called through ctypes (docs/design.md §21, §19).

A kernel is one C source file next to the module that calls it (`csrc/*.c`), compiled by the
system C compiler for this CPU (``-O3 -march=native``) into a cache directory keyed by the
source, the flags, the compiler and the CPU, so a machine builds it once (about a second) and
every process after loads it. The cache directory is created 0700 and used only while it (and
the kernel in it) belongs to this user with no group/other write and is no symlink; otherwise
the refusal is logged and the kernel is built in a fresh private temporary directory: loading a
planted shared object would run someone else's code in the engine.

Without a C compiler, or when the build fails, `load` returns None (logged) and the caller keeps
its torch path: a kernel is a speed-up, never a requirement. ``SWASERVE_KERNEL_CACHE`` moves the
cache (default ``$XDG_CACHE_HOME/swaserve/kernels`` or ``~/.cache/swaserve/kernels``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# NOTE: -ffast-math at compile time only (it lets GCC call glibc's vector expf); linking a
# shared object with it would add crtfastmath.o, which sets flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp-simd", "-ffast-math")
LINK_FLAGS = ("-shared", "-lm")
BUILD_TIMEOUT_S = 120


def cache_dir() -> Path:
    env = os.environ.get("SWASERVE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "swaserve" / "kernels"


def compiler() -> str | None:
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


def kernel_name(cc: str, source: Path) -> str:
    """The cached kernel's file name: keyed by the source, the flags, the compiler and the CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    key = hashlib.sha256(
        "\0".join(
            [source.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, version.stdout, _cpu_signature()]
        ).encode()
    ).hexdigest()[:20]
    return f"{source.stem}-{key}.so"


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


def _compile(cc: str, source: Path, target: Path) -> Path:
    """Compile `source` to `target`, atomically (processes may build it at once)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in (
            [cc, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
            [cc, str(obj), *LINK_FLAGS, "-o", str(lib)],
        ):
            res = subprocess.run(
                cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if res.returncode != 0:
                raise RuntimeError(f"`{shlex.join(cmd)}` failed: {res.stderr.strip()[-2000:]}")
        os.replace(lib, target)
    return target


def build(cc: str, source: Path) -> Path:
    """The kernel of `source` in the private cache, compiled there unless a trusted one is
    already there. Raises OSError when the cache is unusable (UntrustedCacheError: not ours)."""
    target = _private_cache() / kernel_name(cc, source)
    if target.exists():
        why = _untrusted(os.lstat(target), "file")
        if not why:
            return target
        logger.warning("cached kernel %s is %s; building it again", target, why)
    return _compile(cc, source, target)


def _open(path: Path, symbol: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """Load `symbol` from the kernel at `path`, checked again on the file actually opened (no
    symlink, ours, not writable by others) so nothing swapped in after `build` looked is loaded."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        why = _untrusted(os.fstat(fd), "file")
        if why:
            raise UntrustedCacheError(f"kernel {path} is {why}")
        by_fd = Path(f"/proc/self/fd/{fd}")
        lib = ctypes.CDLL(str(by_fd)) if by_fd.exists() else None  # CDLL: calls release the GIL
    except BaseException:
        os.close(fd)
        raise
    if lib is None:  # no /proc (not Linux): loaded by its path, the descriptor not needed
        os.close(fd)
        return ctypes.CDLL(str(path))[symbol]
    # NOTE: the descriptor stays open while the process lives (as the library does): dlopen
    # knows a loaded library by its name, and a second kernel opened through a reused
    # descriptor number would be handed the first one.
    return lib[symbol]


def _load_built(cc: str, source: Path, symbol: str) -> tuple[ctypes._CFuncPtr, str]:  # type: ignore[name-defined]
    """The kernel from the cache or, when the cache is unusable or not ours alone, built in a
    fresh private temporary directory (removed once loaded; never a shared fixed path)."""
    try:
        path = build(cc, source)
        return _open(path, symbol), str(path)
    except UntrustedCacheError as exc:
        logger.warning("%s; refusing it and building the kernel in a private temporary directory", exc)
    except OSError as exc:  # a read-only home (a locked-down container)
        logger.info("kernel cache %s unusable (%s); building in a private temporary directory",
                    cache_dir(), exc)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="swaserve-kernel-") as tmp:  # mkdtemp: 0700, ours
        path = _compile(cc, source, Path(tmp) / kernel_name(cc, source))
        return _open(path, symbol), "a private temporary directory"


def load(source: Path, symbol: str, what: str, fallback: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """`symbol` of the kernel built from `source`, or None (logged: "CPU `what` kernel off
    (`fallback`)") when there is no C compiler or the build fails."""
    cc = compiler()
    if cc is None:
        logger.info("CPU %s kernel off: no C compiler (set CC); %s", what, fallback)
        return None
    try:
        fn, where = _load_built(cc, source, symbol)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU %s kernel off (%s): %s", what, fallback, exc)
        return None
    logger.info("CPU %s kernel loaded from %s", what, where)
    return fn


__all__ = ["build", "cache_dir", "compiler", "kernel_name", "load", "UntrustedCacheError"]
