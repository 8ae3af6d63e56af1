"""Load a model from a local Hugging Face directory (safetensors; no remote code, no network).

The module tree is created on the meta device, materialised empty on the target device in the
target dtype, then every parameter and persistent buffer is filled from the checkpoint by name,
one shard at a time. Quantized checkpoints (config.json's `quantization_config`) are dequantized
into the parameters as their parts arrive, or, with `keep_quantized`, the modules whose weights
are stored packed are swapped for ones that hold them as stored and load them by name
(docs/design.md §16). Missing or unexpected tensors and shape mismatches raise with the names
involved. Under tensor parallelism the tree is cut into this rank's shard before allocation, and
each tensor's slice is copied (docs/design.md §17.2).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from worker.models.causal_lm import CausalLM
from worker.models.quant import Part, QuantFormat, quant_format
from worker.models.registry import model_class
from worker.models.spec import ModelSpec

if TYPE_CHECKING:
    from worker.parallel.group import TPGroup
    from worker.parallel.shard import ShardPlan

# Checkpoint tensors the HF classes ignore too (MiMo's multi-token-prediction head).
_IGNORED_PREFIXES = ("model.mtp.",)


def build_model(
    config: Any,
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """The architecture's module tree with UNINITIALISED weights on `device` in `dtype`."""
    return _build(config, spec, dtype, device, None)[0]


def _build(
    config: Any,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: str | torch.device,
    group: TPGroup | None,
    keep: tuple[QuantFormat, Path] | None = None,
) -> tuple[CausalLM, ShardPlan | None]:
    """All of the tree, or `group`'s rank's shard with the plan that loads it. `keep`: the
    checkpoint's format and directory, whose packed weights the tree keeps as stored (under
    tensor parallelism the experts only: the sharder splits plain linears)."""
    cls = model_class(config.model_type)
    plan = None
    with torch.device("meta"):
        model = cls(config, spec)
        # Cast while still on meta: `to_empty` then allocates each parameter once, in its dtype.
        for name, param in model.named_parameters():
            target = torch.float32 if any(k in name for k in cls.keep_fp32) else dtype
            param.data = param.data.to(target)
        if keep is not None:
            from worker.models.quant.resident import keep_quantized_modules

            quant, model_dir = keep
            stored = _stored_names(_shard_files(model_dir), model)
            names = {n for s, n in stored if not _skipped(s, n, model)}
            targets = {p.target for p in quant.plan(names).values()}
            keep_quantized_modules(model, quant, targets, dense=group is None or group.size == 1)
        if group is not None and group.size > 1:
            from worker.parallel.shard import shard_model

            plan = shard_model(model, group)
    model.to_empty(device=device)
    model.model.place_ropes(torch.device(device))
    model.tie_weights()
    return model.eval(), plan


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


def load_weights(
    model: CausalLM,
    model_dir: str | Path,
    quant: QuantFormat | None = None,
    shard_plan: ShardPlan | None = None,
) -> None:
    """Fill `model` from the directory's safetensors files, strictly by name.

    With `quant`, the stored parts of each quantized parameter are held (packed) until the last
    one is read, then dequantized straight into the parameter: beyond the model, the host holds
    one shard's packed tensors and one dequantized slice at a time (docs/design.md §16). With
    `shard_plan`, each parameter receives its slice and other ranks' experts are skipped.
    """
    shards = _shard_files(Path(model_dir))
    names = {n for s, n in _stored_names(shards, model) if not _skipped(s, n, model)}
    fill = _Fill(model, quant, quant.plan(names) if quant is not None else {}, shard_plan)
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                name = _rename(stored, model.checkpoint_prefixes)
                if not _skipped(stored, name, model):
                    fill.take(stored, name, f.get_tensor)
    fill.check(model_dir, model)


class _Fill:
    """The parameters of one model being filled: which are done, which wait for parts."""

    def __init__(
        self,
        model: CausalLM,
        quant: QuantFormat | None,
        plan: dict[str, Part],
        shard_plan: ShardPlan | None,
    ) -> None:
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.targets.update(dict(model.named_buffers()))
        # A parameter whose every part is a tensor of the model is kept quantized
        # (`worker.models.quant.resident`): its parts load as stored, by their own names.
        by_target: dict[str, list[str]] = {}
        for stored, part in plan.items():
            by_target.setdefault(part.target, []).append(stored)
        self.kept = {
            stored: plan[stored].role
            for names in by_target.values()
            if all(n in self.targets for n in names)
            for stored in names
        }
        plan = {n: p for n, p in plan.items() if n not in self.kept}
        self.quant, self.plan, self.shard_plan = quant, plan, shard_plan
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # target -> role -> stored part
        self.seen: set[str] = set()
        self.unexpected: list[str] = []

    def take(self, stored: str, name: str, read: Callable[[str], torch.Tensor]) -> None:
        part = self.plan.get(name)
        target = name if part is None else part.target
        if self.shard_plan is not None and self.shard_plan.held_elsewhere(target):
            return
        if target not in self.targets:
            self.unexpected.append(stored)
        elif part is None:
            tensor = read(stored)
            if name in self.kept:
                assert self.quant is not None, "kept parts come from a format's plan"
                tensor = self.quant.as_kept(self.kept[name], tensor)
            self._copy(name, tensor)
            self.seen.add(name)
        else:
            assert self.quant is not None, "a plan comes from a format"
            parts = self.pending.setdefault(target, {})
            parts[part.role] = read(stored)
            if len(parts) == len(self.quant.parts):
                with torch.no_grad():
                    self._dequantize(target, self.pending.pop(target))
                self.seen.add(target)

    def _copy(self, name: str, src: torch.Tensor) -> None:
        piece = self.shard_plan.slices.get(name) if self.shard_plan is not None else None
        dst = self.targets[name]
        if piece is None:
            _copy(dst, src, name)
            return
        _check_shape(name, src.shape, piece.full_shape(dst))
        with torch.no_grad():
            piece.copy_into(dst, piece.take(src))

    def _dequantize(self, target: str, parts: dict[str, torch.Tensor]) -> None:
        assert self.quant is not None
        dst = self.targets[target]
        piece = self.shard_plan.slices.get(target) if self.shard_plan is not None else None
        if piece is None:
            self.quant.dequantize_into(dst, parts, target)
        elif piece.dim == 0 and all(
            p.dim() > 0 and p.shape[0] == piece.full for p in parts.values()
        ):
            # Every part is indexed by the sliced dim first (MXFP4 experts): slice them packed.
            self.quant.dequantize_into(dst, {r: piece.take(p) for r, p in parts.items()}, target)
        else:
            # NOTE: one dequantized parameter on the host, then its slice (FP8 tiles need not
            # align with the shard's rows; docs/design.md §17.2).
            whole = torch.empty(piece.full_shape(dst), dtype=dst.dtype)
            self.quant.dequantize_into(whole, parts, target)
            piece.copy_into(dst, piece.take(whole).to(dst.device))

    def check(self, model_dir: str | Path, model: CausalLM) -> None:
        skip = {"lm_head.weight"} if model.tie_word_embeddings else set()
        missing = sorted(set(self.targets) - self.seen - skip)
        unexpected = self.unexpected
        if missing or unexpected:
            raise ValueError(
                f"checkpoint in {model_dir} does not match {type(model).__name__}: "
                f"missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
            )


def _stored_names(shards: list[Path], model: CausalLM) -> list[tuple[str, str]]:
    """(stored, renamed) for every tensor; reads the headers only, no tensor data."""
    names: list[tuple[str, str]] = []
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            names.extend((k, _rename(k, model.checkpoint_prefixes)) for k in f.keys())
    return names


def _skipped(stored: str, name: str, model: CausalLM) -> bool:
    if stored.startswith(_IGNORED_PREFIXES + model.ignored_prefixes):
        return True
    return model.tie_word_embeddings and name == "lm_head.weight"


def _rename(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...] | torch.Size) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(got)} != model shape {tuple(want)}; "
            "the config.json does not describe these weights"
        )


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    _check_shape(name, src.shape, dst.shape)
    with torch.no_grad():
        dst.copy_(src)


def load_model(
    model_dir: str | Path,
    spec: ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: Any | None = None,
    group: TPGroup | None = None,
    keep_quantized: bool = False,
) -> CausalLM:
    """Build the architecture named by config.json and load its weights.

    Args:
        model_dir: a local HF directory (config.json + model.safetensors[.index.json]); its
            weights may be quantized as `worker.models.quant.SUPPORTED` lists.
        spec: the model spec built from the same config (`worker.models.hf_config`).
        dtype / device: where and how the weights live.
        config: an already loaded HF config (else read from `model_dir`).
        group: a tensor-parallel group: load this rank's shard (`worker.parallel.shard`).
        keep_quantized: keep the weights a quantized checkpoint stores packed as stored,
            dequantized per call (`worker.models.quant.resident`; under `group` of two or
            more ranks, the experts only); else all at load.
    """
    if config is None:
        from worker.models.hf_config import (
            load_hf_config,  # lazy: hf_config builds "tiny" with this loader
        )

        config = load_hf_config(model_dir)
    quant = quant_format(config)  # refuses an unknown method before anything is allocated
    keep = (quant, Path(model_dir)) if keep_quantized and quant is not None else None
    model, shard_plan = _build(config, spec, dtype, device, group, keep)
    load_weights(model, model_dir, quant, shard_plan)
    if keep is not None:
        from worker.models.quant.fp8_kernel import use_fp8_kernels
        from worker.models.quant.mxfp4_kernel import use_fused_kernels

        # GPU kernels that read the packed form where they can run; else why not (logged)
        use_fused_kernels(model, torch.device(device), dtype)
        use_fp8_kernels(model, torch.device(device), dtype)
    return model
