"""Load a model from a local Hugging Face directory (safetensors; no remote code, no network).

The module tree is created on the meta device, materialised empty on the target device in the
target dtype, then every parameter and persistent buffer is filled from the checkpoint by name.
Missing or unexpected tensors and shape mismatches raise with the names involved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.models.causal_lm import CausalLM
from worker.models.registry import model_class
from worker.models.spec import ModelSpec

# Checkpoint tensors the HF classes ignore too (MiMo's multi-token-prediction head).
_IGNORED_PREFIXES = ("model.mtp.",)


def load_hf_config(model_dir: str | Path) -> Any:
    """The directory's config.json through transformers, offline and without remote code."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        str(model_dir), local_files_only=True, trust_remote_code=False
    )


def build_model(
    config: Any,
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """The architecture's module tree with UNINITIALISED weights on `device` in `dtype`."""
    cls = model_class(config.model_type)
    with torch.device("meta"):
        model = cls(config, spec)
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        target = torch.float32 if any(k in name for k in cls.keep_fp32) else dtype
        param.data = param.data.to(target)
    model.tie_weights()
    return model.eval()


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json; save the model "
        "with save_pretrained(safe_serialization=True)"
    )


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Fill `model` from the directory's safetensors files, strictly by name."""
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    tied = model.tie_word_embeddings
    ignored = _IGNORED_PREFIXES + model.ignored_prefixes
    seen: set[str] = set()
    unexpected: list[str] = []
    for path in _shard_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                name = _rename(stored, model.checkpoint_prefixes)
                if stored.startswith(ignored) or (tied and name == "lm_head.weight"):
                    continue
                if name not in targets:
                    unexpected.append(stored)
                    continue
                _copy(targets[name], f.get_tensor(stored), name)
                seen.add(name)
    skip = {"lm_head.weight"} if tied else set()
    missing = sorted(set(targets) - seen - skip)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
        )


def _rename(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}; "
            "the config.json does not describe these weights"
        )
    with torch.no_grad():
        dst.copy_(src)


def load_model(
    model_dir: str | Path,
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: Any | None = None,
) -> CausalLM:
    """Build the architecture named by config.json and load its weights.

    Args:
        model_dir: a local HF directory (config.json + model.safetensors[.index.json]).
        spec: the model spec built from the same config (`worker.models.hf_config`).
        dtype / device: where and how the weights live.
        config: an already loaded HF config (else read from `model_dir`).
    """
    config = config if config is not None else load_hf_config(model_dir)
    model = build_model(config, spec, dtype=dtype, device=device)
    load_weights(model, model_dir)
    return model
