"""spec_from_hf_config / load_spec on tiny configs built with the real transformers classes."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from transformers import (
    Cohere2Config,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MiMoV2FlashConfig,
    MistralConfig,
    Qwen2Config,
)

from worker.errors import ConfigError
from worker.models.hf_config import load_spec, spec_from_hf_config
from worker.models.spec import KindShape, LayerKind

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def _split(spec) -> str:
    return "".join("s" if k is LayerKind.SWA else "f" for k in spec.layer_kinds)


def test_gpt_oss_alternates_sliding_first_with_sinks_everywhere() -> None:
    """GPT-OSS: layer_types sliding/full alternate, window = sliding_window - 1, sinks on all."""
    spec = spec_from_hf_config(
        GptOssConfig(num_hidden_layers=4, sliding_window=8, head_dim=16, **SMALL)
    )
    assert _split(spec) == "sfsf" and spec.window == 7
    assert spec.full.has_sinks and spec.swa.has_sinks
    assert (spec.full.num_kv_heads, spec.full.head_dim, spec.full.v_head_dim) == (2, 16, 16)
    assert spec.architecture == "gpt_oss" and spec.is_hybrid


def test_gemma2_carries_softcaps_and_query_scalar() -> None:
    """Gemma 2: alternating layers, both softcaps and query_pre_attn_scalar reach the spec."""
    cfg = Gemma2Config(
        num_hidden_layers=4, sliding_window=16, head_dim=16, query_pre_attn_scalar=24, **SMALL
    )
    spec = spec_from_hf_config(cfg)
    assert _split(spec) == "sfsf" and spec.window == 15
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (50.0, 30.0)
    assert spec.query_pre_attn_scalar == 24 and not spec.full.has_sinks


def test_gemma3_text_uses_sliding_window_pattern() -> None:
    """Gemma 3: the (deprecated) sliding_window_pattern decides the split through HF."""
    default = spec_from_hf_config(Gemma3TextConfig(num_hidden_layers=6, sliding_window=8, **SMALL))
    assert _split(default) == "sssssf" and default.window == 7
    p3 = spec_from_hf_config(
        Gemma3TextConfig(num_hidden_layers=6, sliding_window=8, sliding_window_pattern=3, **SMALL)
    )
    assert _split(p3) == "ssfssf"


def test_gemma3_multimodal_uses_text_config() -> None:
    """Gemma3ForConditionalGeneration configs are read through their text_config."""
    cfg = Gemma3Config(
        text_config=dict(num_hidden_layers=6, sliding_window=32, head_dim=16, **SMALL)
    )
    spec = spec_from_hf_config(cfg)
    assert spec.architecture == "gemma3_text" and _split(spec) == "sssssf" and spec.window == 31
    assert spec.hidden_size == 64


def _mimo(**kw) -> MiMoV2FlashConfig:
    base = dict(
        num_hidden_layers=6,
        head_dim=16,
        v_head_dim=8,
        moe_intermediate_size=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        intermediate_size=32,
    )
    return MiMoV2FlashConfig(**{**SMALL, **base, **kw})


def test_mimo_swa_layers_have_double_kv_heads_and_sinks_only_there() -> None:
    """MiMo-V2-Flash: full at 0 and every 6th, SWA with 2x KV heads + sinks, v_head_dim differs."""
    spec = spec_from_hf_config(_mimo())
    assert _split(spec) == "fssssf" and spec.window == 128  # HF sliding_window 129
    assert spec.full == KindShape(4, 2, 16, 8, has_sinks=False)
    assert spec.swa == KindShape(4, 4, 16, 8, has_sinks=True)


def test_mimo_hub_fields_agree_and_sliding_window_size_maps_to_window() -> None:
    """The hub's swa_* fields and hybrid_layer_pattern are accepted when they match HF's build."""
    cfg = _mimo(
        sliding_window_size=16,
        swa_num_key_value_heads=4,
        swa_head_dim=16,
        swa_v_head_dim=8,
        hybrid_layer_pattern=[0, 1, 1, 1, 1, 0],
        add_swa_attention_sink_bias=True,
    )
    spec = spec_from_hf_config(cfg)
    assert spec.window == 16 and spec.swa.num_kv_heads == 4


def test_mimo_pattern_or_swa_fields_disagreeing_with_hf_are_rejected() -> None:
    """A hub pattern or swa_* shape transformers would not build is a ConfigError."""
    with pytest.raises(ConfigError, match="hybrid_layer_pattern disagrees .* layers \\[1\\]"):
        spec_from_hf_config(_mimo(hybrid_layer_pattern=[0, 0, 1, 1, 1, 0]))
    with pytest.raises(ConfigError, match="swa_"):
        spec_from_hf_config(_mimo(swa_num_key_value_heads=2))


def test_mistral_is_all_swa_or_all_full() -> None:
    """Mistral: sliding_window set -> every layer slides; None -> every layer is full."""
    swa = spec_from_hf_config(MistralConfig(num_hidden_layers=3, sliding_window=4, **SMALL))
    assert _split(swa) == "sss" and swa.window == 3 and swa.is_all_swa
    full = spec_from_hf_config(MistralConfig(num_hidden_layers=3, sliding_window=None, **SMALL))
    assert _split(full) == "fff" and full.window is None and not full.has_swa


def test_qwen2_slides_layers_from_max_window_layers_only_when_enabled() -> None:
    """Qwen2: layer i slides iff use_sliding_window and i >= max_window_layers."""
    on = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2, **SMALL
    )
    spec = spec_from_hf_config(on)
    assert _split(spec) == "ffss" and spec.window == 3
    off = Qwen2Config(
        num_hidden_layers=4,
        use_sliding_window=False,
        sliding_window=4,
        max_window_layers=2,
        **SMALL,
    )
    assert _split(spec_from_hf_config(off)) == "ffff"


def test_cohere2_pattern_of_four() -> None:
    """Cohere2: every 4th layer is full; head_dim = hidden / heads."""
    spec = spec_from_hf_config(Cohere2Config(num_hidden_layers=8, sliding_window=6, **SMALL))
    assert _split(spec) == "sssfsssf" and spec.window == 5 and spec.full.head_dim == 16


def test_unknown_architecture_lists_supported_ones() -> None:
    """A Llama config is rejected, naming the supported model types."""
    with pytest.raises(ConfigError, match="llama.*gpt_oss.*mimo_v2_flash"):
        spec_from_hf_config(LlamaConfig(num_hidden_layers=2, **SMALL))


def test_sliding_window_without_resolvable_split_is_rejected() -> None:
    """sliding_window set but layer_types missing: the error says to set layer_types."""
    cfg = Gemma2Config(num_hidden_layers=4, sliding_window=16, **SMALL)
    cfg.layer_types = None
    with pytest.raises(ConfigError, match="set layer_types to 4 entries"):
        spec_from_hf_config(cfg)


def test_window_below_one_is_rejected() -> None:
    """sliding_window=1 leaves window 0: refused with the fix."""
    with pytest.raises(ConfigError, match="set sliding_window >= 2"):
        spec_from_hf_config(GptOssConfig(num_hidden_layers=2, sliding_window=1, **SMALL))


def test_load_spec_reads_a_local_directory(tmp_path: Path) -> None:
    """A directory with config.json loads offline."""
    GptOssConfig(num_hidden_layers=2, sliding_window=8, **SMALL).save_pretrained(tmp_path)
    spec = load_spec(tmp_path)
    assert _split(spec) == "sf" and spec.window == 7


def test_load_spec_tiny_uses_the_builtin_model_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name "tiny" resolves through worker.models.tiny.ensure_tiny_model (imported lazily)."""
    Gemma2Config(num_hidden_layers=2, sliding_window=4, **SMALL).save_pretrained(tmp_path)
    fake = types.ModuleType("worker.models.tiny")
    fake.ensure_tiny_model = lambda: tmp_path  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.models.tiny", fake)
    assert load_spec("tiny").architecture == "gemma2"


def test_load_spec_rejects_missing_paths_and_unsupported_dirs(tmp_path: Path) -> None:
    """Neither tiny nor a config dir -> ConfigError; a Llama dir -> unsupported architecture."""
    with pytest.raises(ConfigError, match="never downloads"):
        load_spec("openai/gpt-oss-20b")
    LlamaConfig(num_hidden_layers=2, **SMALL).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="unsupported architecture model_type='llama'"):
        load_spec(tmp_path)


@pytest.mark.parametrize(
    ("name", "n_full", "n_swa", "window"),
    [
        ("gpt-oss-120b", 18, 18, 127),
        ("gpt-oss-20b", 12, 12, 127),
        ("mimo-v2-flash", 9, 39, 128),
        ("gemma-3-27b-it", 10, 52, 1023),
    ],
)
def test_shipped_bench_configs_load(name: str, n_full: int, n_swa: int, window: int) -> None:
    """The real config.json files shipped with the memory bench give the published splits."""
    path = Path(__file__).parents[3] / "bench" / "configs" / f"{name}.json"
    spec = load_spec(path)
    split = (len(spec.full_layer_ids), len(spec.swa_layer_ids), spec.window)
    assert split == (n_full, n_swa, window)
