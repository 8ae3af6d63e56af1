"""What a quantized checkpoint format is to the loader (docs/design.md §16).

A format names the stored tensors that together make one model parameter (its *parts*, each a
suffix of the parameter's name), and writes their dequantized value into that parameter. The
loader reads parts shard by shard, holds only the parts of parameters still incomplete (packed,
small), and dequantizes each parameter as soon as its last part arrives.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """One stored tensor's place: the parameter it belongs to and its role there."""

    target: str
    role: str


class QuantFormat(ABC):
    """One `quantization_config.quant_method`.

    Subclasses set `method` (the config's name for it), `parts` (role → suffix appended to the
    parameter name; a suffix may be empty: the stored tensor then has the parameter's own name)
    and `marker` (the role whose presence says a parameter is quantized; its suffix is never
    empty), and implement `dequantize_into`.
    """

    method: str
    parts: Mapping[str, str]
    marker: str

    def __init__(self, modules_to_not_convert: Sequence[str] = ()) -> None:
        self.modules_to_not_convert = tuple(modules_to_not_convert)

    def converts(self, module: str) -> bool:
        """False for modules `modules_to_not_convert` lists: their tensors load as stored.

        Matching is transformers': a pattern matches from the start up to a module boundary
        (as a regex: ``model.layers.*.self_attn``), or as a suffix (``lm_head``).
        """
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(
            re.match(rf"(?:{p}){boundary}", module) or module.endswith(p)
            for p in self.modules_to_not_convert
        )

    def plan(self, names: Iterable[str]) -> dict[str, Part]:
        """Stored name → `Part` for every stored tensor that is part of a quantized parameter.

        Raises ValueError naming a parameter whose marker is stored but another part is not.
        """
        names = set(names)
        marker = self.parts[self.marker]
        out: dict[str, Part] = {}
        for name in sorted(n for n in names if n.endswith(marker)):
            target = name[: -len(marker)]
            if not self.converts(target.rpartition(".")[0]):
                continue
            absent = [target + s for s in self.parts.values() if target + s not in names]
            if absent:
                raise ValueError(
                    f"{self.method} checkpoint: {name} is stored but {absent} is not; "
                    "the checkpoint is incomplete"
                )
            out.update({target + s: Part(target, role) for role, s in self.parts.items()})
        return out

    def as_kept(self, role: str, stored: torch.Tensor) -> torch.Tensor:
        """A stored part as a module that keeps the parameter quantized holds it
        (`worker.models.quant.resident`): as stored unless the format says otherwise."""
        return stored

    @abstractmethod
    def dequantize_into(self, dst: torch.Tensor, parts: dict[str, torch.Tensor], name: str) -> None:
        """Write the parameter that `parts` (role → stored tensor) encode into `dst`.

        Args:
            dst: the model's parameter (its device and dtype are the compute ones).
            parts: every role of `self.parts`, as stored (on the host).
            name: the parameter's name, for error messages.
        Raises:
            ValueError: the parts' shapes or dtypes do not encode a tensor of `dst`'s shape.
        """


def check_shape(name: str, got: Sequence[int], want: Sequence[int], what: str) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(
            f"{name}: {what} {tuple(got)} != {tuple(want)} that the model's shape needs; "
            "the config.json does not describe these weights"
        )


def sm90_unavailable(device: torch.device, dtype: torch.dtype, kernel: str) -> str | None:
    """Why `kernel` (an SM90 kernel taking bfloat16 activations) cannot run on `device` in
    `dtype`; None when the device can run it (whether the library imports is the caller's)."""
    if device.type != "cuda":
        return f"{kernel} is CUDA's (device {device.type})"
    if dtype != torch.bfloat16:
        return f"{kernel} takes bfloat16 activations here (dtype {dtype})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"{kernel} is SM90's (this GPU is SM{major}{minor})"
    return None
