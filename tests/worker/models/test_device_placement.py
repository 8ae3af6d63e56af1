"""Nothing in a forward makes a host tensor for a device model: rope frequencies are placed on
the model's device at load, Gemma's embedding scale is a Python float. On CPU the check runs the
layers on the meta device and records every tensor a torch call returns on the host (a CUDA
model would copy each of them to the device per call: a sync, illegal in a graph capture)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from worker.models.layers import ScaledEmbedding
from worker.models.rope import Rotary, rope_inv_freq

META = torch.device("meta")


class _HostTensors(TorchFunctionMode):
    """Records the torch functions that returned a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_function__(self, func: Callable[..., object], types: object, args: tuple = (), kwargs: dict | None = None) -> object:  # fmt: skip
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.made.append(getattr(func, "__name__", str(func)))
        return out


def test_rope_on_the_device_makes_no_host_tensor() -> None:
    """A placed rope computes cos/sin on the positions' device without copying its
    frequencies there (the copy was per call before)."""
    rope = Rotary(*rope_inv_freq({"rope_theta": 10000.0}, 16, 128), "neox")
    rope.to(META)
    positions = torch.arange(5, device=META)
    with _HostTensors() as mode:
        cs = rope(positions, torch.bfloat16)
    assert cs.cos.device == META and mode.made == []


def test_scaled_embedding_makes_no_host_tensor() -> None:
    """Gemma's scaled lookup on a device weight: no scalar tensor built on the host per call,
    and the scale is the float32 value rounded to the weight dtype, as HF's."""
    with torch.device(META):
        emb = ScaledEmbedding(32, 8, 8**0.5).to(torch.bfloat16)
    with _HostTensors() as mode:
        out = emb(torch.arange(4, device=META))
    assert out.device == META and mode.made == []
    want = torch.tensor(8**0.5, dtype=torch.float32).to(torch.bfloat16).item()
    assert emb.scales[torch.bfloat16] == want != 8**0.5
