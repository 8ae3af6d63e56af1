"""The machine's foreign load during a run: CPU time spent by processes that are not the run's.

On a shared machine a run's figures mean little without how busy the machine was with other
work. The 1-minute load average mixes that with the run's own processes, so a `LoadProbe` also
measures it apart: between `start` and `stop`, the CPU seconds the whole machine spent busy
(``/proc/stat``: user, nice, system, irq, softirq, steal) minus those of the server's process
tree (`procs.descendants` of the PID the harness started) and of this process (the client),
divided by the wall time: the cores other work kept busy. A server process that exits during the
run loses its CPU time from the sum (the foreign figure then reads a little high).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from bench.compare.procs import PROC, descendants
from bench.machine import load_average

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


@dataclass(frozen=True)
class ForeignLoad:
    wall_s: float
    busy_cores: float  # the whole machine, averaged over the run
    own_cores: float  # the server's processes and the client
    load_before: float  # 1-minute load averages
    load_after: float

    @property
    def foreign_cores(self) -> float:
        return max(0.0, self.busy_cores - self.own_cores)


def machine_busy_seconds(proc_root: Path = PROC) -> float:
    """CPU seconds all cores spent busy since boot."""
    with (proc_root / "stat").open() as f:
        fields = f.readline().split()
    assert fields[0] == "cpu", f"unexpected first line of {proc_root / 'stat'}: {fields[:2]}"
    values = [int(v) for v in fields[1:]]
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int, proc_root: Path = PROC) -> dict[int, float]:
    """PID → CPU seconds of `root` and every process below it."""
    return {p.pid: p.cpu_s for p in descendants(root, proc_root)}


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class LoadProbe:
    """Measures one run: `start()` before it, `stop()` after."""

    def __init__(self, server_pid: int, proc_root: Path = PROC) -> None:
        self._pid, self._root = server_pid, proc_root

    def start(self) -> None:
        self._t0, self._busy0 = time.monotonic(), machine_busy_seconds(self._root)
        self._tree0, self._own0 = tree_cpu_seconds(self._pid, self._root), own_cpu_seconds()
        self._load0 = load_average()

    def stop(self) -> ForeignLoad:
        wall = max(1e-9, time.monotonic() - self._t0)
        busy = machine_busy_seconds(self._root) - self._busy0
        tree1 = tree_cpu_seconds(self._pid, self._root)
        tree = sum(cpu - self._tree0.get(pid, 0.0) for pid, cpu in tree1.items())
        own = tree + own_cpu_seconds() - self._own0
        return ForeignLoad(wall, busy / wall, own / wall, self._load0, load_average())
