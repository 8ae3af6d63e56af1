"""Suite-wide settings.

NOTE: torch's default intra-op threads (one per core) make every test 8-20x slower when Ray
workers or other processes share the 2 cores of a CI machine; one thread per process is both
faster and steadier there. Benchmarks (`swaserve bench`) keep torch's default.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
