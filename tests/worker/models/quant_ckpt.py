"""Quantized checkpoints written the way the published ones are (the test side's own packers).

- MXFP4 (GPT-OSS experts): round-to-nearest-even E2M1 codes, two per byte (low nibble first),
  with the smallest E8M0 block scale that needs no clipping (``ceil(log2(amax / 6))``, what
  OpenAI's and triton's downcasts use), in HF's ``*_blocks`` / ``*_scales`` layout.
- Block FP8 (MiMo-V2-Flash): e4m3 weights scaled per tile by ``amax / 448`` and the inverse
  scales as float32 ``weight_scale_inv``.

Non-quantized tensors are stored as bfloat16, as in the published checkpoints. Files are split
into shards with an index, and one parameter's parts can land in different shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip
FP8_MAX = 448.0

GPT_OSS_NOT_CONVERTED = [  # the published GPT-OSS config's list
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes nearest to `x` (|x| <= 6); ties go to the even code (mantissa bit 0)."""
    dist = (x.unsqueeze(-1) - _E2M1).abs()
    tie = dist == dist.amin(-1, keepdim=True)
    even = tie & (torch.arange(16) % 2 == 0)
    return torch.where(even.any(-1), even.int().argmax(-1), tie.int().argmax(-1))


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, in, out]`` → (blocks uint8 ``[E, out, in/32, 16]``, scales uint8 ``[E, out, in/32]``)."""
    t = w.float().transpose(1, 2)
    groups = t.reshape(*t.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # amax 0: -inf -> -127
    codes = _nearest_e2m1(groups / torch.exp2(exp).unsqueeze(-1))
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` → (e4m3 ``[N, K]``, float32 inverse scales ``[ceil(N/bn), ceil(K/bk)]``)."""
    (n, k), (bn, bk) = w.shape, block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w.float()
    tiles = padded.view(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(gn * bn, gk * bk)[:n, :k].to(torch.float8_e4m3fn), scale_inv


def mxfp4_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT-OSS state dict in the published layout: experts packed, the rest bfloat16."""
    out = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = pack_mxfp4(t)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def fp8_tensors(
    state: dict[str, torch.Tensor], block: tuple[int, int], not_converted: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Every 2-D ``*.weight`` whose name contains none of `not_converted` as e4m3 + scales."""
    skip = tuple(not_converted) + ("norm",)
    out = {}
    for name, t in state.items():
        if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip):
            out[name], out[name + "_scale_inv"] = quantize_fp8(t, block)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def write_checkpoint(
    path: Path, config: Any, tensors: dict[str, torch.Tensor], shards: list[list[str]]
) -> None:
    """config.json (with its `quantization_config`) and `tensors` split as `shards` lists."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    assert sorted(n for s in shards for n in s) == sorted(tensors), "every tensor in one shard"
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.nbytes for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def shards_by_layer(names: Iterable[str], moves: dict[str, int] | None = None) -> list[list[str]]:
    """One shard per decoder layer plus one for the rest; `moves` puts names elsewhere."""
    by: dict[int, list[str]] = {}
    for n in sorted(names):
        layer = int(n.split(".")[2]) + 1 if n.startswith("model.layers.") else 0
        by.setdefault((moves or {}).get(n, layer), []).append(n)
    return [by[k] for k in sorted(by)]
