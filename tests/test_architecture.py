"""The layering is enforced by tools, not by review: import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "cluster", "router", "deploy", "bench")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_import_contracts_hold() -> None:
    """Every import-linter contract of pyproject.toml is kept by the tree as it is."""
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("worker/config.py", "import deploy.config", "layers"),
        ("worker/outputs.py", "import ray", "worker imports neither Ray nor HTTP code"),
        ("cluster/messages.py", "import torch", "import no torch"),
    ],
)
def test_import_contracts_catch_a_violation(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    """A copy of the tree with one forbidden import breaks the contract that names it."""
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # the violation\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [ln for ln in result.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(contract in ln for ln in broken), result.stdout


def test_router_and_cluster_load_without_torch() -> None:
    """The router's decision path and the cross-process types import no torch at runtime."""
    code = (
        "import sys, cluster.messages, cluster.index, router.core, router.policies; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
