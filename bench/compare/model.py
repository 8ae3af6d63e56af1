"""The model `swaserve bench vllm-compare` serves on both sides: a random Gemma-3 text model.

46 M parameters, float32: hidden 512, 12 layers in the 5:1 sliding/full pattern (layers 5 and 11
full), 8 query heads and 2 KV heads of dim 64, MLP 2048, HF ``sliding_window`` 128, 4,096
positions, tied head. The tokenizer is the built-in tiny model's (a byte-level BPE of 1,024
tokens trained on a fixed corpus, `worker.models.tiny`), so nothing is downloaded. Weights are
drawn with fan-in scaling from a fixed seed (`bench.engine.model.randomize`): every machine
builds byte-identical files, which vLLM, transformers and swaserve all load.

The directory is built once under ``<cache root>/models/<COMPARE_VERSION>`` (the tiny model's
cache root, ``$SWASERVE_CACHE_DIR`` or ``~/.cache/swaserve``), atomically: in a temporary
sibling, then `os.replace`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

COMPARE_VERSION = "gemma3-46m-v1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
_FILES = ("config.json", "model.safetensors", *_TOKENIZER_FILES)


@dataclass(frozen=True)
class CompareModelShape:
    hidden: int = 512
    layers: int = 12
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 2048
    sliding_window: int = 128  # HF's value (docs/design.md §1: our window is one less)
    full_every: int = 6  # 5 sliding layers, then one full
    max_positions: int = 4096


def ensure_compare_model(
    cache_dir: Path | None = None, shape: CompareModelShape | None = None
) -> Path:
    """The comparison model's directory, built on the first call (then reused).

    Args:
        cache_dir: the cache root; default the tiny model's (`default_cache_root()`).
        shape: a different shape (tests build a small one); the directory name records it.
    """
    from worker.models.tiny import default_cache_root

    shape = shape or CompareModelShape()
    name = COMPARE_VERSION if shape == CompareModelShape() else f"{COMPARE_VERSION}-{_tag(shape)}"
    target = Path(cache_dir or default_cache_root()) / "models" / name
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build_compare_model(tmp, shape)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _complete(target):  # another process won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_compare_model(out_dir: Path, shape: CompareModelShape) -> None:
    """Write config, weights and the tiny tokenizer into `out_dir` (deterministic)."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.engine.model import SEED, randomize
    from worker.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    for file in _TOKENIZER_FILES:
        shutil.copyfile(tiny / file, out_dir / file)
    config = gemma3_config(shape, tiny)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model)
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_bytes((tiny / "generation_config.json").read_bytes())


def gemma3_config(shape: CompareModelShape, tokenizer_dir: Path) -> object:
    """A `Gemma3TextConfig` of `shape` with the vocab and special ids of the tiny model."""
    import json

    from transformers import Gemma3TextConfig

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    gen = json.loads((tokenizer_dir / "generation_config.json").read_text())
    layer_types = [
        "full_attention" if (i + 1) % shape.full_every == 0 else "sliding_attention"
        for i in range(shape.layers)
    ]
    return Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        query_pre_attn_scalar=shape.head_dim,
        sliding_window=shape.sliding_window,
        layer_types=layer_types,
        max_position_embeddings=shape.max_positions,
        bos_token_id=gen["bos_token_id"],
        eos_token_id=gen["eos_token_id"],
        pad_token_id=gen["pad_token_id"],
        tie_word_embeddings=True,
        dtype="float32",
    )


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _FILES)


def _tag(shape: CompareModelShape) -> str:
    return "-".join(str(v) for v in dataclasses.astuple(shape))
