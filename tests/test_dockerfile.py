"""The image's CUDA choice (Dockerfile): the Ray base's CUDA, the index torch comes from and the
build's check all name one version, torch is the project's pin, and bench/ is in the image."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _arg(name: str) -> str:
    found = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert found, f"Dockerfile has no ARG {name}=..."
    return found[1]


def test_base_torch_and_toolkit_name_one_cuda_version() -> None:
    """The default base is Ray's image for CUDA `CUDA` (cuXYZ tag), torch is installed from the
    index of that version before anything else could pull PyPI's (CUDA 13) build, and the
    build fails unless torch's CUDA and the base's nvcc are that version."""
    cuda = _arg("CUDA")
    tag = "cu" + cuda.replace(".", "")
    assert _arg("RAY_IMAGE").endswith(f"-{tag}"), (_arg("RAY_IMAGE"), cuda)
    torch_install = DOCKERFILE.index("--index-url \"https://download.pytorch.org/whl/cu$(echo ${CUDA} | tr -d .)\"")
    assert torch_install < DOCKERFILE.index("pip install -r /tmp/requirements.txt")
    assert "torch.version.cuda.startswith('${CUDA}')" in DOCKERFILE
    assert 'nvcc --version | grep -q "release ${CUDA}"' in DOCKERFILE


def test_torch_is_the_project_pin() -> None:
    """The torch line installed first is pyproject's exact pin (a local +cuXYZ version
    satisfies it, so the requirements install keeps that build)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torch")]
    assert re.fullmatch(r"torch==[\d.]+", pin), pin
    assert "$(grep '^torch==' /tmp/requirements.txt)" in DOCKERFILE


def test_bench_is_in_the_image() -> None:
    """`swaserve bench gpu-check` runs in the image: bench/ is not ignored and the build runs it."""
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "bench" not in ignored
    assert "swaserve bench gpu-check --help" in DOCKERFILE
