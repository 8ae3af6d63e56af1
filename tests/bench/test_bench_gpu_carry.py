"""The device check's carry: which wheel members it keeps, the tarball `build` writes (the
package's `__init__` replaced), the include closure `verify` compares, and, where the carry has
been built in the checkout, its size with the repository under the device's 64 MiB."""

from __future__ import annotations

import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

from bench import gpu_carry

ROOT = Path(__file__).resolve().parents[2]


def test_kept_members() -> None:
    keep = ["flashinfer/prefill.py", "flashinfer/jit/attention/modules.py", "flashinfer/data/csrc/batch_prefill.cu",
            "flashinfer/data/include/flashinfer/attention/prefill.cuh", "flashinfer/data/cutlass/include/cute/tensor.hpp",
            "flashinfer/data/cccl/libcudacxx/include/cuda/std/atomic"]  # fmt: skip
    drop = ["flashinfer/experimental/b12x/moe/kernel.py", "flashinfer/fused_moe/core.py", "flashinfer/data/csrc/fmha_v2/x.cu",
            "flashinfer/data/cutlass/examples/a.cu", "flashinfer/data/aot/m/m.so", "flashinfer/jit/__pycache__/core.pyc",
            "flashinfer_python-0.7.4.dist-info/METADATA", "flashinfer/jit/"]  # fmt: skip
    assert [n for n in keep if not gpu_carry.kept(n)] == []
    assert [n for n in drop if gpu_carry.kept(n)] == []


def _wheel(path: Path, members: dict[str, str]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)


def test_build_writes_the_trimmed_tarball_and_the_tvm_wheel(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels / gpu_carry.FLASHINFER_WHEEL, {
        "flashinfer/__init__.py": "from .fused_moe import everything\n",
        "flashinfer/prefill.py": "X = 1\n",
        "flashinfer/fused_moe/core.py": "Y = 2\n",
        "flashinfer/data/csrc/a.cu": '#include "a.h"\n',
        "flashinfer/data/csrc/sub/b.cu": "",
    })  # fmt: skip
    _wheel(wheels / "apache_tvm_ffi-0.1.15-cp312-cp312-manylinux_2_28_x86_64.whl", {"tvm_ffi/__init__.py": ""})
    _wheel(wheels / gpu_carry.TRANSFORMERS_WHEEL, {"transformers/__init__.py": ""})
    files = dict(gpu_carry.build(wheels, tmp_path / "carry"))
    assert set(files) == {gpu_carry.TARBALL, "apache_tvm_ffi-0.1.15-cp312-cp312-manylinux_2_28_x86_64.whl",
                          gpu_carry.TRANSFORMERS_WHEEL}  # fmt: skip
    with tarfile.open(tmp_path / "carry" / gpu_carry.TARBALL) as tar:
        assert sorted(tar.getnames()) == ["flashinfer/__init__.py", "flashinfer/data/csrc/a.cu", "flashinfer/prefill.py"]
        init = tar.extractfile("flashinfer/__init__.py")
        assert init is not None and init.read().decode() == gpu_carry.TRIMMED_INIT
    assert gpu_carry.tree_bytes([tmp_path / "carry"]) == sum(files.values())


def test_carried_transformers_is_the_pinned_one() -> None:
    pin = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
               if d.startswith("transformers=="))  # fmt: skip
    assert gpu_carry.TRANSFORMERS_WHEEL == f"transformers-{pin.split('==')[1]}-py3-none-any.whl"


def test_include_closure_follows_the_jit_search_order(tmp_path: Path) -> None:
    """A quoted include is looked up beside its includer first, then in the JIT's order; a
    name found nowhere is left to the toolkit."""
    data = tmp_path / "data"
    for rel, text in {
        "include/flashinfer/a.cuh": '#include "b.cuh"\n#include <cuda/std/utility>\n#include <cuda_runtime.h>\n',
        "include/flashinfer/b.cuh": "",
        "cccl/libcudacxx/include/cuda/std/utility": '#  include "detail/u.h"\n',
        "cccl/libcudacxx/include/cuda/std/detail/u.h": "",
        "csrc/gen.cu": '#include "flashinfer/a.cuh"\n',
    }.items():  # fmt: skip
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text(text)
    found, missing = gpu_carry.include_closure([data / "csrc/gen.cu"], data)
    assert set(found) == {"include/flashinfer/a.cuh", "include/flashinfer/b.cuh",
                          "cccl/libcudacxx/include/cuda/std/utility", "cccl/libcudacxx/include/cuda/std/detail/u.h"}  # fmt: skip
    assert missing == {"cuda_runtime.h"}


@pytest.mark.skipif(not (ROOT / ".gpucarry" / gpu_carry.TARBALL).exists(), reason="the carry is not built here (python -m bench.gpu_carry build)")
def test_built_carry_fits_the_device_limit_with_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    repo = gpu_carry.tree_bytes(ROOT / p for p in tracked.decode().split("\0") if p and (ROOT / p).is_file())
    carry = gpu_carry.tree_bytes([ROOT / ".gpucarry"])
    assert repo + carry < gpu_carry.CARRY_LIMIT, f"repository {repo / 2**20:.1f} MiB + carry {carry / 2**20:.1f} MiB"


def test_device_script_installs_what_build_writes() -> None:
    """The device script unpacks the tarball and the wheels `build` writes, from the carried
    folder the docs name, and hands its arguments to gpu-check with $OUT."""
    script = (ROOT / "bench" / "gpu_device_check.sh").read_text()
    assert f"tar -xJf .gpucarry/{gpu_carry.TARBALL}" in script and ".gpucarry/*.whl" in script
    assert '"gpu-check"' in script and '--out "$OUT" "$@"' in script
    design = (ROOT / "docs" / "design.md").read_text()
    assert "bash bench/gpu_device_check.sh" in design and 'carry `[".gpucarry"]`' in design
