"""Every torch-backend test runs on both paths: the padded groups and the CPU kernel."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from worker import native
from worker.attention import cpu_kernel


@dataclass
class FakePool:
    """Only what the torch backend reads: one (K, V) buffer pair for every layer."""

    k: torch.Tensor
    v: torch.Tensor

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype


def kernel_missing() -> str | None:
    """Why the CPU kernel cannot run here (no C compiler, or the build failed); None: it can."""
    if native.compiler() is None:
        return "no C compiler: the CPU attention kernel cannot be built here"
    if cpu_kernel._load() is None:
        return "the CPU attention kernel did not build (see the log)"
    return None


@pytest.fixture(params=[False, True], ids=["groups", "kernel"])
def kernel(request: pytest.FixtureRequest) -> bool:
    if request.param:
        why = kernel_missing()
        if why:
            pytest.skip(why)
    return request.param
