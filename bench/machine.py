"""What a benchmark ran on: cores, CPU model, RAM, load, library versions.

Every subcommand records this next to its figures (timings on a shared machine mean little
without the load they ran under).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MachineInfo:
    cpus: int  # os.cpu_count(), what `nproc` shows without affinity limits
    cpu_model: str
    ram_gib: float
    load_avg_1m: float  # when the figures were taken
    torch_threads: int
    python: str
    torch: str
    transformers: str

    def describe(self) -> str:
        return (
            f"{self.cpus} CPUs ({self.cpu_model}), {self.ram_gib:.0f} GiB RAM, torch "
            f"{self.torch} with {self.torch_threads} threads, transformers {self.transformers}, "
            f"Python {self.python}; 1-minute load average {self.load_avg_1m:.2f}"
        )


def machine_info() -> MachineInfo:
    import torch
    import transformers

    return MachineInfo(
        cpus=cpu_count(),
        cpu_model=cpu_model(),
        ram_gib=ram_bytes() / 1024**3,
        load_avg_1m=load_average(),
        torch_threads=torch.get_num_threads(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
    )


def cpu_count() -> int:
    """CPUs this process may run on (what `nproc` prints)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return float("nan")


def cpu_model() -> str:
    """`lscpu`'s "Model name" (read from /proc/cpuinfo), else platform.processor()."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
