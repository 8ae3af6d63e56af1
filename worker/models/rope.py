"""Rotary position embeddings: inverse frequencies per rope type, cos/sin, and the three layouts.

The frequency formulas reproduce `transformers.modeling_rope_utils` (5.24) for the rope types the
supported architectures use: ``default``, ``linear`` (Gemma3 global layers), ``yarn`` (GPT-OSS) and
``llama3``. Layouts differ per architecture:

- ``neox``: rotate the two halves (Llama, Mistral, Qwen2, Gemma, GPT-OSS, MiMo); with a rotary
  dim smaller than the head dim (MiMo's ``partial_rotary_factor``) only the first dims rotate;
- ``interleaved``: rotate even/odd pairs (Cohere2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

RopeLayout = Literal["neox", "interleaved"]
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(
    params: Mapping[str, Any], base: float, dim: int, max_pos: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    orig = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the same guard against a zero-width ramp as the reference
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attention_factor


def _llama3(params: Mapping[str, Any], base: float, dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(
    params: Mapping[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, CPU) and the cos/sin scale for one rope parameter dict.

    Args:
        params: an HF ``rope_parameters`` dict (one layer type's dict for per-type configs).
        head_dim: the q/k head dim; ``partial_rotary_factor`` in `params` shrinks the rotary dim.
        max_position_embeddings: the config's value (YaRN without ``factor`` derives it).
    Returns:
        ``(inv_freq [rotary_dim // 2], attention_scaling)``.
    """
    # NOTE: models are built under a meta-device context; frequencies are not weights and must
    # be real CPU tensors.
    with torch.device("cpu"):
        return _inv_freq(params, head_dim, max_position_embeddings)


def _inv_freq(
    params: Mapping[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_position_embeddings)
    if rope_type == "llama3":
        return _llama3(params, base, dim), 1.0
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


@dataclass(frozen=True)
class CosSin:
    cos: torch.Tensor  # [T, rotary_dim] in the activation dtype, on the activation device
    sin: torch.Tensor
    layout: RopeLayout


class Rotary:
    """cos/sin for a batch of positions. Not an nn.Module: it holds no weights to load."""

    def __init__(
        self, inv_freq: torch.Tensor, attention_scaling: float, layout: RopeLayout
    ) -> None:
        self.inv_freq = inv_freq  # float32, on the CPU until `to` places it (once, at load)
        self.attention_scaling = attention_scaling
        self.layout = layout

    def to(self, device: torch.device) -> None:
        """Place the frequencies on the model's device, once, when the model is allocated.

        NOTE: never per call: a host-to-device copy inside a forward blocks the host, is
        illegal while a CUDA graph captures, and a compiled forward would replay it each call.
        """
        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        freqs = positions[:, None].float() * self.inv_freq
        if self.layout == "neox":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return CosSin(cos, sin, self.layout)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cs: CosSin) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]``; dims past the rotary dim pass through unchanged."""
    cos, sin = cs.cos[:, None, :], cs.sin[:, None, :]
    rot = cos.shape[-1]
    if cs.layout == "interleaved":
        # Cohere rotates in float32 and casts back (HF `apply_rotary_pos_emb` of cohere2).
        xf = x.float()
        return ((xf * cos) + (_rotate_pairs(xf) * sin)).to(x.dtype)
    if rot == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat(((x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass), dim=-1)
