"""`ModelSpec` from a Hugging Face config: which layers slide, the window, KV shapes per kind.

Everything here follows what transformers 5.24's modeling code builds from the config, so the
spec, the HF reference model and our model implementations agree layer by layer:

| model_type      | layer split                                   | KV shape notes                      |
|-----------------|-----------------------------------------------|-------------------------------------|
| gpt_oss         | `layer_types`                                 | sinks on every layer                |
| gemma2, gemma3  | `layer_types` (HF derives it from             | softcaps, `query_pre_attn_scalar`;  |
| (+ gemma3_text) | `sliding_window_pattern`)                     | Gemma3ForConditionalGeneration: the |
|                 |                                               | `text_config` is used               |
| mimo_v2_flash   | `layer_types` (checked against the hub's      | SWA: 2x KV heads, sinks; full: none |
|                 | `hybrid_layer_pattern` when present)          | head_dim 192 / v_head_dim 128       |
| mistral         | `sliding_window` set -> all SWA, None -> full | no `layer_types` (HF ignores it)    |
| qwen2           | `layer_types` (HF: i >= max_window_layers     | `use_sliding_window=False` nulls    |
|                 | slides iff use_sliding_window)                | the window -> all full              |
| cohere2         | `layer_types` (from `sliding_window_pattern`) | head_dim = hidden / heads           |

`window = sliding_window - 1` (docs/design.md §1): HF's window counts the query itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.errors import ConfigError
from worker.models.model_dir import resolve_model_dir
from worker.models.spec import KindShape, LayerKind, ModelSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "gpt_oss": "GPT-OSS",
    "gemma2": "Gemma 2",
    "gemma3": "Gemma 3 (multimodal wrapper; its text_config is used)",
    "gemma3_text": "Gemma 3",
    "mimo_v2_flash": "MiMo-V2-Flash",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "cohere2": "Cohere2",
}
_SLIDING, _FULL = "sliding_attention", "full_attention"
_GEMMA = ("gemma2", "gemma3_text")


def supported_list() -> str:
    return ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())


# ---------------------------------------------------------------- loading


def load_spec(model: str | os.PathLike[str]) -> ModelSpec:
    """Spec for "tiny", a local HF model directory, or a config.json file (no network)."""
    return spec_from_hf_config(load_hf_config(model))


def load_hf_config(model: str | os.PathLike[str]) -> PretrainedConfig:
    """The transformers config for "tiny", a local directory with config.json, or a .json file."""
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        return _auto_config(path)
    try:
        model_dir = resolve_model_dir(model)
    except ConfigError:
        raise ConfigError(
            f"model {str(model)!r} is neither 'tiny' nor a local directory holding config.json "
            f"(nor a config .json file); swaserve never downloads models: point it at a local "
            f"copy. Supported architectures: {supported_list()}"
        ) from None
    return _auto_config(model_dir / "config.json")


def _auto_config(config_file: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(_unsupported(model_type, config_file))
    # NOTE: from_pretrained on the directory would also read config.json; giving the file lets
    # the bench ship bare <name>.json files. trust_remote_code stays off: only built-in classes.
    return AutoConfig.from_pretrained(
        str(config_file), local_files_only=True, trust_remote_code=False
    )


def _unsupported(model_type: object, where: object = None) -> str:
    place = f" in {where}" if where is not None else ""
    return (
        f"unsupported architecture model_type={model_type!r}{place}. "
        f"Supported: {supported_list()}. Use a config with one of these model_type values."
    )


# ---------------------------------------------------------------- config -> spec


def spec_from_hf_config(cfg: PretrainedConfig) -> ModelSpec:
    """Build the spec; raises ConfigError saying what to change when the config cannot work."""
    text = _text_config(cfg)
    arch = getattr(text, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(_unsupported(arch))
    if getattr(text, "use_bidirectional_attention", False):
        raise ConfigError(
            f"{arch}: use_bidirectional_attention=True is an encoder setting; set it False"
        )
    kinds = _layer_kinds(text, arch)
    full, swa = _shapes(text, arch)
    gemma = arch in _GEMMA
    return ModelSpec(
        architecture=arch,
        layer_kinds=kinds,
        window=_window(text, kinds),
        full=full,
        swa=swa,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        max_position_embeddings=text.max_position_embeddings,
        attn_logit_softcapping=getattr(text, "attn_logit_softcapping", None) if gemma else None,
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None) if gemma else None,
        query_pre_attn_scalar=getattr(text, "query_pre_attn_scalar", None) if gemma else None,
    )


def _text_config(cfg: PretrainedConfig) -> PretrainedConfig:
    sub = getattr(cfg, "text_config", None)  # Gemma3ForConditionalGeneration & co.
    return sub if sub is not None else cfg


def _get(cfg: Any, name: str, default: Any) -> Any:
    value = getattr(cfg, name, None)
    return default if value is None else value


def _layer_kinds(text: Any, arch: str) -> tuple[LayerKind, ...]:
    n = text.num_hidden_layers
    sliding_window = getattr(text, "sliding_window", None)
    if arch == "mistral":  # NOTE: MistralConfig has no layer_types; every layer uses sliding_window
        return ((LayerKind.SWA if sliding_window is not None else LayerKind.FULL),) * n
    types: list[str] | None = getattr(text, "layer_types", None)
    if types is None or not _valid_layer_types(types, n):
        if sliding_window is None and types is None:
            return (LayerKind.FULL,) * n
        raise ConfigError(
            f"{arch}: sliding_window={sliding_window} but the layer split cannot be resolved from "
            f"layer_types={types!r}: set layer_types to {n} entries (num_hidden_layers), each "
            f"'{_SLIDING}' or '{_FULL}'"
        )
    kinds = tuple(LayerKind.SWA if t == _SLIDING else LayerKind.FULL for t in types)
    if arch == "mimo_v2_flash":
        _check_mimo_pattern(text, kinds)
    if LayerKind.SWA in kinds and sliding_window is None:
        if arch == "qwen2":  # use_sliding_window=False nulls the window: HF attends fully
            return (LayerKind.FULL,) * n
        raise ConfigError(
            f"{arch}: layer_types marks sliding layers but sliding_window is None; set sliding_window"
        )
    return kinds


def _valid_layer_types(types: Any, n: int) -> bool:
    return types is not None and len(types) == n and set(types) <= {_SLIDING, _FULL}


def _check_mimo_pattern(text: Any, kinds: tuple[LayerKind, ...]) -> None:
    """The hub config's `hybrid_layer_pattern` (1 = SWA) must match what transformers builds."""
    pattern = getattr(text, "hybrid_layer_pattern", None)
    if pattern is None:
        return
    if len(pattern) != len(kinds) or set(pattern) - {0, 1}:
        raise ConfigError(
            f"hybrid_layer_pattern must be {len(kinds)} entries of 0 (full) / 1 (SWA), got {pattern}"
        )
    bad = [i for i, (p, k) in enumerate(zip(pattern, kinds)) if (p == 1) != (k is LayerKind.SWA)]
    if bad:
        raise ConfigError(
            f"mimo_v2_flash: hybrid_layer_pattern disagrees with layer_types at layers {bad}; "
            f"transformers builds layers from layer_types: set layer_types to match the pattern"
        )


def _window(text: Any, kinds: tuple[LayerKind, ...]) -> int | None:
    if LayerKind.SWA not in kinds:
        return None
    hf_window = int(text.sliding_window)
    window = hf_window - 1  # docs/design.md §1: keys to the left of the query
    if window < 1:
        raise ConfigError(
            f"sliding_window={hf_window} leaves window={window} keys to the left; a sliding layer "
            f"needs window >= 1: set sliding_window >= 2 (or make the layers full attention)"
        )
    return window


# ---------------------------------------------------------------- shapes


def _shapes(text: Any, arch: str) -> tuple[KindShape, KindShape]:
    heads = text.num_attention_heads
    kv = _get(text, "num_key_value_heads", heads)
    head_dim = _get(text, "head_dim", text.hidden_size // heads)
    v_head_dim = _get(text, "v_head_dim", head_dim)
    sinks = arch == "gpt_oss"  # GPT-OSS: a sinks parameter on every attention layer
    full = KindShape(heads, kv, head_dim, v_head_dim, has_sinks=sinks)
    if arch == "mimo_v2_flash":
        return full, _mimo_swa_shape(text, full)
    return full, full


def _mimo_swa_shape(text: Any, full: KindShape) -> KindShape:
    """transformers 5.24 builds SWA layers with 2x KV heads and sinks, full layers without sinks;
    the hub config spells the same with swa_* fields, which must agree when present."""
    built = KindShape(full.num_q_heads, 2 * full.num_kv_heads, full.head_dim, full.v_head_dim, True)
    declared = KindShape(
        _get(text, "swa_num_attention_heads", built.num_q_heads),
        _get(text, "swa_num_key_value_heads", built.num_kv_heads),
        _get(text, "swa_head_dim", built.head_dim),
        _get(text, "swa_v_head_dim", built.v_head_dim),
        bool(_get(text, "add_swa_attention_sink_bias", True)),
    )
    if declared != built or _get(text, "add_full_attention_sink_bias", False):
        raise ConfigError(
            f"mimo_v2_flash: the config declares SWA layers {declared} (full sinks: "
            f"{_get(text, 'add_full_attention_sink_bias', False)}) but transformers 5.24 builds "
            f"{built} and no full-layer sinks; fix the swa_* / add_*_sink_bias fields to match"
        )
    return built
