"""The model and prompts `swaserve bench engine` runs on both sides.

By default the built-in tiny model (`worker.models.tiny`). With ``--hidden`` / ``--layers`` a
larger random model of the same architecture is built from its config: the layer-type pattern is
tiled to the new depth, head dim is kept and the head count, MLP and expert widths scale with the
hidden size. Weights are drawn with fan-in scaling (as the tiny model's are) so greedy decoding
sees peaked, not uniform, distributions. Both sides load the same saved directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SEED = 1234
FIRST_PROMPT_ID = 8  # skip the special tokens at the start of the tiny vocab


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    model_type: str
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    parameters: int


def resolve_base(model: str) -> Path:
    """'tiny' (built on first use) or a local HF model directory."""
    from worker.models.model_dir import resolve_model_dir

    return resolve_model_dir(model)


def scaled_model(base: Path, hidden: int | None, layers: int | None, out_dir: Path) -> Path:
    """Save a random model shaped like `base` but with `hidden` width and `layers` depth."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    _rescale(config, hidden or config.hidden_size, layers or config.num_hidden_layers)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model)
    model.save_pretrained(out_dir)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file() and not (out_dir / name).exists():
            (out_dir / name).write_bytes((base / name).read_bytes())
    return out_dir


def _rescale(config: Any, hidden: int, layers: int) -> None:
    base_hidden = config.hidden_size
    if hidden % 32:
        raise ValueError(f"--hidden must be a multiple of 32, got {hidden}")
    grow = hidden / base_hidden
    config.hidden_size = hidden
    config.num_attention_heads = max(1, round(config.num_attention_heads * grow))
    for field in ("intermediate_size", "moe_intermediate_size"):
        if getattr(config, field, None):
            setattr(config, field, max(8, round(getattr(config, field) * grow)))
    for field in ("layer_types", "mlp_layer_types"):
        pattern = getattr(config, field, None)
        if pattern:
            setattr(config, field, [pattern[i % len(pattern)] for i in range(layers)])
    config.num_hidden_layers = layers


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Fan-in-scaled random weights from `SEED` (peaked, not uniform, next-token distributions)."""
    gen = torch.Generator().manual_seed(SEED)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif p.dim() == 1:  # biases and sinks
            p.copy_(0.1 * noise)
        else:
            scale = 2.0 if name.endswith("lm_head.weight") else 1.0
            p.copy_(noise * scale * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def model_info(name: str, path: Path) -> ModelInfo:
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    params = 0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            params += sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return ModelInfo(
        name=name,
        path=str(path),
        model_type=cfg.get("model_type", "?"),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        layer_types=tuple(cfg.get("layer_types") or ()),
        vocab_size=int(cfg["vocab_size"]),
        parameters=params,
    )


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_prompts(count: int, length: int, vocab: int, seed: int = SEED) -> list[list[int]]:
    """`count` random prompts of `length // 2 … length` tokens (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    low = min(FIRST_PROMPT_ID, vocab // 2)
    lengths = torch.randint(max(1, length // 2), length + 1, (count,), generator=gen).tolist()
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]
