"""The repository's docs stand alone: no citation of documents outside it, every
`docs/design.md §N` citation names a section that exists, and the §4.1 example runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"

# Documents that live outside the repository (a clone does not have them).
OUTSIDE_CITATION = re.compile(
    r"\.\./shared|shared/reference|reference §|sglang_swa\.md|DESIGN §|DESIGN\.md"
    r"|\b(?:peers|ray_serve|env)\.md|STYLE habit"
)
DESIGN_CITATION = re.compile(r"docs/design\.md §(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.M)
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".tpl")
TEXT_NAMES = ("Dockerfile", "Makefile")


def _repo_files() -> list[str]:
    """Tracked files plus new ones git does not ignore (so an uncommitted edit counts too)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):  # not a git checkout (e.g. an sdist)
        skip = {".git", ".venv", "node_modules", "__pycache__", "build"}
        out = [
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts)
        ]
    return sorted(f for f in out if f.endswith(TEXT_SUFFIXES) or f.rsplit("/", 1)[-1] in TEXT_NAMES)


def _hits(pattern: re.Pattern[str], files: list[str]) -> list[str]:
    found = []
    for path in files:
        full = REPO / path
        if not full.is_file():  # listed by git but deleted in the working tree
            continue
        for n, line in enumerate(full.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path}:{n}: {line.strip()}")
    return found


def design_sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text()))


def test_no_citation_of_documents_outside_the_repo() -> None:
    """Outside tests/, nothing cites ../shared, the private reference notes or the old DESIGN
    map: `docs/design.md §N` says it instead."""
    files = [f for f in _repo_files() if not f.startswith("tests/")]
    assert not (hits := _hits(OUTSIDE_CITATION, files)), "\n".join(hits)


def test_design_citations_name_existing_sections() -> None:
    sections = design_sections()
    assert {"1", "2", "3", "4.1", "4.2", "4.3", "4.4", "5"} <= sections
    bad = [
        hit
        for hit in _hits(DESIGN_CITATION, _repo_files())
        for number in DESIGN_CITATION.findall(hit)
        if number not in sections
    ]
    assert not bad, "cited sections missing from docs/design.md:\n" + "\n".join(bad)


def test_citation_check_catches_a_bad_section(tmp_path: Path) -> None:
    """The section check is not vacuous: a citation of a missing section is found."""
    bogus = tmp_path / "x.py"
    cite = "docs/design.md " + "§"  # split, so this file does not cite a missing section
    bogus.write_text(f"# see {cite}99.9 and {cite}4.1\n")
    numbers = DESIGN_CITATION.findall(bogus.read_text())
    assert numbers == ["99.9", "4.1"]
    assert [n for n in numbers if n not in design_sections()] == ["99.9"]


def _section_41_example() -> str:
    text = DESIGN.read_text()
    start = re.search(r"^### 4\.1 ", text, re.M)
    assert start is not None, "docs/design.md has no §4.1"
    end = re.compile(r"^#{2,3} ", re.M).search(text, start.end())
    section = text[start.end() : end.start() if end else len(text)]
    block = re.search(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert block is not None, "docs/design.md §4.1 has no python example"
    return block.group(1)


@pytest.mark.timeout(120)
def test_section_41_engine_example_runs() -> None:
    """The engine example of docs/design.md §4.1 runs as written (tiny model, CPU, a few s)."""
    code = _section_41_example()
    assert "from worker import Engine, EngineConfig, SamplingParams" in code
    exec(compile(code, "docs/design.md §4.1", "exec"), {"__name__": "design_example"})
