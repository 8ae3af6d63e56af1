"""Rope frequencies vs transformers, the registry's errors, the loader's strictness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.models.conftest import Archs
from worker.models.hf_config import spec_from_hf_config
from worker.models.loader import load_model
from worker.models.registry import model_class, supported_model_types
from worker.models.rope import rope_inv_freq


def _hf_rope(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", layer_type=layer_type)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},  # GPT-OSS
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    ],
)  # fmt: skip
def test_rope_frequencies_equal_transformers(rope: dict) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=131072,
        rope_parameters=dict(rope),
    )
    want, want_scale = _hf_rope(cfg)
    got, scale = rope_inv_freq(cfg.rope_parameters, 64, cfg.max_position_embeddings)
    assert torch.equal(got, want)
    assert scale == pytest.approx(want_scale)


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="dynamic.*supported: default, linear, yarn, llama3"):
        rope_inv_freq({"rope_type": "dynamic", "rope_theta": 1.0}, 16, 16)


def test_registry_lists_supported_types() -> None:
    assert {
        "gpt_oss",
        "mimo_v2_flash",
        "gemma2",
        "gemma3_text",
        "mistral",
        "qwen2",
        "cohere2",
    } <= set(supported_model_types())
    with pytest.raises(ValueError, match="'llama' is not supported; supported: cohere2, gemma2"):
        model_class("llama")


def _copy_with(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_and_unexpected_tensors_are_named(archs: Archs, tmp_path: Path) -> None:
    arch = archs["gpt_oss"]

    def edit(t: dict) -> None:
        t.pop("model.layers.1.self_attn.sinks")
        t["model.layers.1.extra"] = torch.zeros(1)

    bad = _copy_with(arch.tiny.path, tmp_path / "bad", edit)
    with pytest.raises(
        ValueError, match=r"missing \['model.layers.1.self_attn.sinks'\].*model.layers.1.extra"
    ):
        load_model(bad, arch.spec)


def test_shape_mismatch_is_named(archs: Archs, tmp_path: Path) -> None:
    arch = archs["mimo_v2_flash"]

    def edit(t: dict) -> None:
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)

    bad = _copy_with(arch.tiny.path, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match="k_proj.weight: checkpoint shape"):
        load_model(bad, arch.spec)


def test_tied_head_follows_the_embedding(archs: Archs) -> None:
    """Gemma ties lm_head to the embedding: no separate tensor, same storage after loading."""
    arch = archs["gemma2"]
    assert arch.model.lm_head.weight is arch.model.model.embed_tokens.weight


def test_bfloat16_load_keeps_listed_params_in_float32(archs: Archs) -> None:
    """Like HF's _keep_in_fp32_modules: MiMo's router stays float32 in a bf16 model."""
    arch = archs["mimo_v2_flash"]
    model = load_model(arch.tiny.path, spec_from_hf_config(arch.tiny.config), dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32
    assert dtypes["model.layers.1.self_attn.q_proj.weight"] == torch.bfloat16


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """model_type gemma3 (vision + text): the LM loads from `language_model.*`, the vision tower
    is skipped, and greedy decoding matches HF's multimodal class on text input."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from tests.worker.models.driver import Driver
    from tests.worker.models.hf_tiny import hf_greedy, randomize

    text = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, intermediate_size=96, sliding_window=9, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
        image_token_index=299, boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    randomize(hf, "gemma3", seed=3)
    hf.save_pretrained(tmp_path)
    spec = spec_from_hf_config(cfg)
    drv = Driver(spec, load_model(tmp_path, spec), page_size=4)
    prompt = list(range(5, 40))
    seq = drv.add(prompt, 8)
    drv.run([seq])
    tokens, logits = hf_greedy(hf, prompt, 8)
    assert seq.out == tokens
    assert (torch.stack(seq.logits) - logits).abs().max() < 1e-4
