from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.worker.models.hf_tiny import ARCHS, TinyHF, hf_greedy, make_tiny
from worker.models.hf_config import spec_from_hf_config
from worker.models.loader import load_model


class Arch:
    """One architecture's oracle (HF model) and our model, loaded from its saved directory."""

    def __init__(self, tiny: TinyHF) -> None:
        self.tiny = tiny
        self.spec = spec_from_hf_config(tiny.config)
        self.model = load_model(tiny.path, self.spec)
        self.window = self.spec.window

    @functools.cache  # noqa: B019 - one instance per arch per session
    def reference(self, prompt: tuple[int, ...], max_new: int) -> tuple[list[int], torch.Tensor]:
        return hf_greedy(self.tiny.model, list(prompt), max_new)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_hf")


class Archs:
    """Builds each architecture once per session, on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Arch] = {}

    def __getitem__(self, name: str) -> Arch:
        if name not in self._built:
            if name not in ARCHS:
                raise KeyError(f"unknown arch {name!r}; known: {ARCHS}")
            self._built[name] = Arch(make_tiny(name, self.root))
        return self._built[name]


@pytest.fixture(scope="session")
def archs(tiny_root: Path) -> Archs:
    return Archs(tiny_root)


def prompt_of(length: int, seed: int, vocab: int = 128) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (length,), generator=gen).tolist()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> object:
    """NOTE: the test machines are small and shared; intra-op threads fighting other processes
    made this suite ~8x slower. The models are tiny: one thread is fastest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
