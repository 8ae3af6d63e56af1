"""Suite-wide settings.

NOTE: torch's default intra-op threads (one per core) make every test 8-20x slower when Ray
workers or other processes share the 2 cores of a CI machine; one thread per process is both
faster and steadier there. Benchmarks (`swaserve bench`) keep torch's default.

`--cpu-hogs N` runs N CPU-burning processes beside the whole session (`make test-loaded`, the
Ray and e2e modules on a busy machine; tests/cpu_hogs.py).

Hypothesis runs derandomized (the profile "suite"); `pytest --hypothesis-profile explore` draws new
examples.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

from tests.cpu_hogs import cpu_hogs

torch.set_num_threads(1)

# The suite's hypothesis examples are the same on every run (a CI failure reproduces on any
# machine); `--hypothesis-profile explore` draws fresh ones.
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("suite")
# Every runner of the suite compares its device page table with the host tables after each step
# and checks every FULL key slot (worker/runner/model_runner.py; O(tokens), off in production).
os.environ.setdefault("SWASERVE_CHECK_TABLES", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hogs",
        type=int,
        default=0,
        help="CPU-burning processes to run beside the whole session (the loaded mode)",
    )


@pytest.fixture(scope="session", autouse=True)
def _session_cpu_hogs(request: pytest.FixtureRequest) -> Iterator[None]:
    with cpu_hogs(request.config.getoption("--cpu-hogs")):
        yield
