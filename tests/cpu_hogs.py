"""CPU-burning processes beside a test: the busy CI machine, on purpose.

`make test-loaded` (`pytest -m ray --cpu-hogs 2`, tests/conftest.py) runs the Ray and e2e modules
with two of them for the whole session; a test that must hold on a busy machine asks for them
itself with `cpu_hogs(n)`, which only tops up what already runs. Each hog is a `python -c` busy
loop that exits on its own when the process that started it is gone or after `max_s`, and is
stopped by its PID when the block ends.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

MAX_S = 3600.0  # a hog outlives no test run by more than this, whatever happens to pytest

_HOG = """
import os, time
parent, end = os.getppid(), time.monotonic() + {max_s}
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(200_000):
        pass
"""

_running: list[subprocess.Popen[bytes]] = []


@contextmanager
def cpu_hogs(n: int, max_s: float = MAX_S) -> Iterator[int]:
    """At least `n` hogs run inside the block (those already running count); yields how many."""
    started = [
        subprocess.Popen([sys.executable, "-c", _HOG.format(max_s=max_s)])
        for _ in range(max(0, n - len(_running)))
    ]
    _running.extend(started)
    try:
        yield len(_running)
    finally:
        for proc in started:
            _running.remove(proc)
            proc.kill()
            proc.wait(10)
