"""The type checker runs on the packages and the fakes (config: [tool.mypy] in pyproject.toml).

It is what keeps the seams honest: `FakeEngine` and `AsyncEngine` must satisfy `EngineClient`,
`SimRunner` and `ModelRunner` must satisfy `Runner` (tests/fakes/conformance.py), and the modules
on those seams may not use `Any`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MYPY = [sys.executable, "-m", "mypy"]


def _mypy(root: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MYPY, "--cache-dir", str(cache), "--no-error-summary"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_packages_and_fakes_type_check(tmp_path: Path) -> None:
    """mypy finds nothing in worker/, cluster/, router/, deploy/, bench/ and tests/fakes/."""
    result = _mypy(REPO, tmp_path / "cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_fake_that_drifts_fails_the_type_check(tmp_path: Path) -> None:
    """A copy of the tree whose FakeEngine lost `stats()` fails, naming the protocol."""
    root = tmp_path / "tree"
    for name in ("core", "worker", "cluster", "router", "deploy", "bench", "swaserve", "tests"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    fake = root / "tests" / "fakes" / "fake_engine.py"
    source = fake.read_text()
    assert "    def stats(self) -> EngineStats:" in source
    fake.write_text(source.replace("    def stats(self) -> EngineStats:", "    def _stats(self) -> EngineStats:"))
    result = _mypy(root, tmp_path / "cache")
    assert result.returncode != 0
    assert "conformance.py" in result.stdout and "EngineClient" in result.stdout, result.stdout
