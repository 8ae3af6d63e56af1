"""The device check's carry: FlashInfer brought to a machine with no package index
(docs/design.md §18.3).

The lent GPU machine's image has torch (CUDA 13), Triton, nvcc and ninja but neither FlashInfer
nor its compiled dependency apache-tvm-ffi, and nothing can be fetched there; what travels is at
most 64 MiB with the repository. The flashinfer-python wheel is ~100 MB (~720 MB unpacked), so
`build` keeps only what `import flashinfer` and the JIT build of the attention kernels the check
runs read, in one xz tarball:

| kept | why |
| --- | --- |
| the package's top-level modules and `KEPT_PACKAGES` | the import closure of the two wrappers the backend uses, and their JIT generators (`verify` checks the closure) |
| `__init__.py` replaced by `TRIMMED_INIT` | the wheel's imports every kernel family (cute-dsl, MoE, comm), whose dependencies the image lacks |
| `data/`: `KEPT_DATA` and csrc's top-level files | the headers and templates the JIT compiles (`verify` resolves every include) |

Two wheels travel beside it as they are: apache-tvm-ffi for the device's Python (3.12), and
the transformers the project pins (the image's is older; the check's models and configs are
tested against the pin). The image has every other dependency of both.

    python -m bench.gpu_carry build  --wheels W --out .gpucarry
    python -m bench.gpu_carry verify --carry .gpucarry --wheels W --local-site L

`verify` proves on a machine without CUDA what the device would otherwise find out: the trimmed
tree imports (from `L`, a site with this machine's tvm-ffi, einops, tabulate, nvidia-ml-py), every
module it loads is kept, the JIT sources of every module the check needs generate, and every
header those sources reach resolves in the trimmed tree to the file the whole wheel has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

FLASHINFER_WHEEL = "flashinfer_python-0.7.4-py3-none-any.whl"
TVM_FFI_GLOB = "apache_tvm_ffi-*-cp312-*.whl"  # the device's python3 is 3.12
TRANSFORMERS_WHEEL = "transformers-5.24.0-py3-none-any.whl"  # pyproject's pin (a test checks)
TARBALL = "flashinfer.tar.xz"
CARRY_LIMIT = 64 * 1024 * 1024  # the repository and every carried path together
KEPT_PACKAGES = ("attention", "autotuner", "cudnn", "cute_dsl", "cutile", "jit", "mla", "quantization", "trace")
KEPT_DATA = (
    "include", "cutlass/include", "cutlass/tools/util/include", "spdlog/include",
    "cccl/cub", "cccl/libcudacxx/include", "cccl/thrust",
)  # fmt: skip
# The include search order of FlashInfer's JIT (jit/cpp_ext.py): vendored CCCL first, then
# FlashInfer's own headers, csrc, CUTLASS, spdlog (the toolkit's and Python's come between).
SEARCH_ORDER = (
    "cccl/cub", "cccl/libcudacxx/include", "cccl/thrust", "include", "csrc",
    "cutlass/include", "cutlass/tools/util/include", "spdlog/include",
)  # fmt: skip
TRIMMED_INIT = '''"""FlashInfer trimmed for swaserve's device check: the two wrappers its backend uses."""

from .version import __version__ as __version__
from .prefill import BatchPrefillWithPagedKVCacheWrapper as BatchPrefillWithPagedKVCacheWrapper
from .attention import BatchAttentionWithAttentionSinkWrapper as BatchAttentionWithAttentionSinkWrapper
'''
# (sinks, head_dim_qk, head_dim_vo, sliding window) x backend: what the check's models and
# kernel cases plan (gpu_check: Gemma-style 128, GPT-OSS-style 64 with sinks, MiMo 192/128).
JIT_MODULES = (
    (False, 128, 128, True), (False, 128, 128, False), (True, 64, 64, True),
    (False, 64, 64, False), (False, 192, 128, False), (True, 192, 128, True),
)  # fmt: skip
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


# ---- build --------------------------------------------------------------------------------------
def kept(name: str) -> bool:
    """Whether a wheel member (``flashinfer/...``) goes into the carry."""
    parts = name.split("/")
    if parts[0] != "flashinfer" or name.endswith("/") or "__pycache__" in parts:
        return False
    rest = parts[1:]
    if len(rest) == 1:
        return rest[0].endswith(".py")
    if rest[0] in KEPT_PACKAGES:
        return rest[-1].endswith(".py")
    if rest[0] != "data":
        return False
    data = "/".join(rest[1:])
    if rest[1] == "csrc":
        return len(rest) == 3  # csrc's top level: the JIT's templates and bindings
    return any(data.startswith(d + "/") for d in KEPT_DATA)


def build(wheels: Path, out: Path) -> list[tuple[str, int]]:
    """Write the carry into `out`: the trimmed tarball, the device's tvm-ffi wheel and the
    pinned transformers wheel. Returns (file, bytes) per file written."""
    out.mkdir(parents=True, exist_ok=True)
    tvm = sorted(wheels.glob(TVM_FFI_GLOB))
    if not tvm or not (wheels / TRANSFORMERS_WHEEL).is_file():
        raise FileNotFoundError(f"{wheels} needs {TVM_FFI_GLOB} and {TRANSFORMERS_WHEEL} (pip download, docs/design.md §18.3)")
    with zipfile.ZipFile(wheels / FLASHINFER_WHEEL) as whl, tarfile.open(out / TARBALL, "w:xz", preset=1) as tar:
        for info in sorted(whl.infolist(), key=lambda i: i.filename):
            if not kept(info.filename):
                continue
            data = TRIMMED_INIT.encode() if info.filename == "flashinfer/__init__.py" else whl.read(info)
            member = tarfile.TarInfo(info.filename)
            member.size, member.mode, member.mtime = len(data), 0o644, 0
            tar.addfile(member, _Reader(data))
    for wheel in (tvm[-1], wheels / TRANSFORMERS_WHEEL):
        (out / wheel.name).write_bytes(wheel.read_bytes())
    return [(p.name, p.stat().st_size) for p in sorted(out.iterdir())]


class _Reader:
    """A bytes object as the file `tarfile.addfile` reads."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        chunk, self.pos = self.data[self.pos : end], min(end, len(self.data))
        return chunk


def tree_bytes(paths: Iterable[Path]) -> int:
    """Bytes of every file under `paths` (what a device call carries)."""
    total = 0
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
        total += sum(p.stat().st_size for p in files)
    return total


# ---- verify -------------------------------------------------------------------------------------
def include_closure(sources: Iterable[Path], data: Path) -> tuple[dict[str, Path], set[str]]:
    """Every header the sources reach through FlashInfer's own include directories (a quoted
    include first beside its includer), ignoring conditionals (a superset of what compiles):
    resolved header name -> file, and the names found in none of them (the toolkit's, the C++
    library's, Python's, tvm-ffi's)."""
    dirs = [data / d for d in SEARCH_ORDER]
    found: dict[str, Path] = {}
    missing: set[str] = set()
    todo = [(p, p.parent) for p in sources]
    seen: set[Path] = set()
    while todo:
        path, here = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for quote, name in INCLUDE.findall(path.read_text(errors="replace")):
            cands = ([here] if quote == '"' else []) + dirs
            hit = next((d / name for d in cands if (d / name).is_file()), None)
            if hit is None:
                missing.add(name)
                continue
            found.setdefault(str(hit.relative_to(data)) if hit.is_relative_to(data) else name, hit)
            todo.append((hit, hit.parent))
    return found, missing


_PROBE = r"""
import json, sys, torch
import flashinfer
from flashinfer.attention._core import BatchAttentionWithAttentionSinkWrapper as W
from flashinfer.jit.attention import modules as m
bf, out = torch.bfloat16, {"sources": [], "errors": []}
for sinks, dqk, dvo, swa in json.loads(sys.argv[1]):
    for backend in ("fa2", "fa3"):
        try:
            if sinks:
                _, args, kw = W._sink_jit_args(torch.device("cpu"), backend, bf, bf, dqk, dvo, 127 if swa else -1)
                spec = m.gen_customize_batch_prefill_module(backend, *args, **kw)
            else:
                spec = m.gen_batch_prefill_module(backend, bf, bf, bf, torch.int32, dqk, dvo, 0, swa, False, False)
            out["sources"] += [str(p) for p in spec.sources]
        except Exception as exc:
            out["errors"].append(f"{backend} sinks={sinks} {dqk}/{dvo}: {type(exc).__name__}: {exc}")
out["modules"] = sorted({m.__file__ for n, m in sys.modules.items() if n.split(".")[0] == "flashinfer" and getattr(m, "__file__", None)})
out["cuda"] = torch.cuda.is_available()
print(json.dumps(out))
"""


def probe(site: Path, local_site: Path, work: Path) -> dict[str, list[str]]:
    """Import the trimmed tree in a fresh interpreter without CUDA and generate the check's JIT
    sources (FlashInfer writes them under `work`; nothing compiles)."""
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{local_site}", CUDA_VISIBLE_DEVICES="",
               FLASHINFER_WORKSPACE_BASE=str(work), FLASHINFER_CUDA_ARCH_LIST="9.0a")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(JIT_MODULES)], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the trimmed flashinfer failed to import:\n{done.stderr[-3000:]}")
    result: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def verify(carry: Path, wheels: Path, local_site: Path) -> list[str]:
    """The proof lines; raises AssertionError on the first thing the device would miss."""
    lines = [f"carry {carry}: " + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in sorted(carry.iterdir()))]
    with tempfile.TemporaryDirectory(prefix="gpu-carry-") as tmp:
        site, full = Path(tmp) / "site", Path(tmp) / "full"
        with tarfile.open(carry / TARBALL) as tar:
            tar.extractall(site, filter="data")
        with zipfile.ZipFile(wheels / FLASHINFER_WHEEL) as whl:
            whl.extractall(full, [n for n in whl.namelist() if n.startswith("flashinfer/data/")])
        got = probe(site, local_site, Path(tmp) / "ws")
        assert not got["cuda"], "the probe ran where CUDA is visible"
        assert not got["errors"], "JIT sources failed to generate:\n" + "\n".join(got["errors"])
        outside = [f for f in got["modules"] if not f.startswith(str(site))]
        assert not outside, f"modules loaded from outside the trimmed tree: {outside[:5]}"
        lines.append(f"import flashinfer without CUDA: ok, {len(got['modules'])} modules, all in the carry")
        sources = [Path(s) for s in got["sources"]]
        lines.append(f"JIT sources generated: {len(sources)} files of {2 * len(JIT_MODULES)} modules (FA2 and FA3)")
        trimmed, missing = include_closure(sources, site / "flashinfer" / "data")
        whole, _ = include_closure(sources, full / "flashinfer" / "data")
        lost = sorted(set(whole) - set(trimmed))
        assert not lost, f"headers the whole wheel has and the carry lacks: {lost[:10]}"
        differ = sorted(n for n in trimmed if n in whole and trimmed[n].read_bytes() != whole[n].read_bytes())
        assert not differ, f"headers that differ from the wheel's: {differ[:10]}"
        lines.append(f"include closure: {len(trimmed)} headers, every one the wheel resolves is in the carry; "
                     f"{len(missing)} names left to the toolkit/system (e.g. {', '.join(sorted(missing)[:4])})")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_carry", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the carry")
    b.add_argument("--wheels", type=Path, required=True, help=f"holds {FLASHINFER_WHEEL}, {TVM_FFI_GLOB}, {TRANSFORMERS_WHEEL}")
    b.add_argument("--out", type=Path, default=Path(".gpucarry"))
    v = sub.add_parser("verify", help="prove here (no CUDA) that the carry imports and builds")
    v.add_argument("--carry", type=Path, default=Path(".gpucarry"))
    v.add_argument("--wheels", type=Path, required=True)
    v.add_argument("--local-site", type=Path, required=True, help="this machine's tvm-ffi, einops, tabulate, nvidia-ml-py")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        for name, size in build(args.wheels, args.out):
            print(f"{args.out / name}: {size / 2**20:.1f} MiB")
        return 0
    for line in verify(args.carry, args.wheels, args.local_site):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
