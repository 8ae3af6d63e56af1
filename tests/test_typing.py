"""The type checker runs on the packages and the fakes (config: [tool.mypy] in pyproject.toml).

It is what keeps the seams honest: `FakeEngine` and `AsyncEngine` must satisfy `EngineClient`,
`SimRunner` and `ModelRunner` must satisfy `Runner` (tests/fakes/conformance.py), and the modules
on those seams may not use `Any`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MYPY = [sys.executable, "-m", "mypy"]
FAKE = REPO / "tests" / "fakes" / "fake_engine.py"


def _mypy(cache: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MYPY, "--cache-dir", str(cache), "--no-error-summary", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module: the drift check re-checks only what the drift touches."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_the_packages_and_fakes_type_check(cache: Path) -> None:
    """mypy finds nothing in worker/, cluster/, router/, deploy/, bench/ and tests/fakes/."""
    result = _mypy(cache)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_fake_that_drifts_fails_the_type_check(cache: Path, tmp_path: Path) -> None:
    """The tree with a FakeEngine that lost `stats()` (read from a shadow file, the tree left
    as it is) fails, naming the protocol."""
    source = FAKE.read_text()
    assert "    def stats(self) -> EngineStats:" in source
    shadow = tmp_path / "fake_engine.py"
    shadow.write_text(source.replace("    def stats(self) -> EngineStats:", "    def _stats(self) -> EngineStats:"))
    result = _mypy(cache, "--shadow-file", str(FAKE), str(shadow))
    assert result.returncode != 0
    assert "conformance.py" in result.stdout and "EngineClient" in result.stdout, result.stdout
