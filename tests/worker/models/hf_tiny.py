"""Tiny random Hugging Face models of every supported architecture (the parity oracle).

Weights are re-drawn with scales that give O(1) logits (HF's own init, std 0.02, makes nearly
uniform logits that any implementation would "match"). Each model is saved with
`save_pretrained`, so loading it also exercises the checkpoint layout on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 128

# HF sliding_window per arch: window = sliding_window - 1 (docs/design.md §1), 8 to 16 here.
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    # Default rope_parameters: YaRN, factor 32, original 4096.
    return GptOssConfig(
        **_COMMON, num_hidden_layers=4, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=9, max_position_embeddings=4096,
    )  # fmt: skip


def _mimo() -> Any:
    from transformers import MiMoV2FlashConfig

    # SWA: 2x KV heads + sinks; v_head_dim 8 != head_dim 16; partial rotary 0.334 -> 6 dims.
    return MiMoV2FlashConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, v_head_dim=8,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        sliding_window=17, max_position_embeddings=1024,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(
        **_COMMON, num_hidden_layers=4, intermediate_size=96, sliding_window=9,
        query_pre_attn_scalar=20, attn_logit_softcapping=8.0, final_logit_softcapping=6.0,
        max_position_embeddings=1024,
    )  # fmt: skip


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_COMMON, num_hidden_layers=4, intermediate_size=96, sliding_window=13,
        query_pre_attn_scalar=24, final_logit_softcapping=6.0, max_position_embeddings=1024,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
    )  # fmt: skip


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        **_COMMON,
        num_hidden_layers=3,
        intermediate_size=96,
        sliding_window=9,
        max_position_embeddings=1024,
    )


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **_COMMON, num_hidden_layers=4, intermediate_size=96, use_sliding_window=True,
        sliding_window=9, max_window_layers=2, max_position_embeddings=1024,
    )  # fmt: skip


def _cohere2() -> Any:
    from transformers import Cohere2Config

    c = {k: v for k, v in _COMMON.items() if k != "head_dim"}  # cohere2 derives head_dim
    return Cohere2Config(
        **c, num_hidden_layers=4, intermediate_size=96, sliding_window=9, logit_scale=0.5,
        max_position_embeddings=1024,
    )  # fmt: skip


CONFIGS = {
    "gpt_oss": _gpt_oss,
    "mimo_v2_flash": _mimo,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "cohere2": _cohere2,
}
ARCHS = tuple(CONFIGS)


def _std(name: str, p: torch.Tensor, arch: str) -> float:
    if p.dim() >= 2:
        # GPT-OSS stores experts transposed ([E, in, out]); everything else is [.., out, in].
        fan_in = p.shape[-2] if arch == "gpt_oss" and "experts" in name else p.shape[-1]
        return fan_in**-0.5
    return 0.5


@torch.no_grad()
def randomize(model: torch.nn.Module, arch: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * _std(name, p, arch))
        if "norm" in name and not arch.startswith("gemma"):
            p.add_(1.0)  # (Gemma norms multiply by 1 + w already)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


@dataclass(frozen=True)
class TinyHF:
    arch: str
    config: Any
    model: Any  # the transformers model (eager attention), float32, eval
    path: Path  # its save_pretrained directory


def make_tiny(arch: str, root: Path, seed: int = 0, **overrides: Any) -> TinyHF:
    """The tiny model of `arch`, with config fields replaced by `overrides` (FlashInfer's tests
    need head dims in multiples of 16)."""
    from transformers import AutoModelForCausalLM

    config = CONFIGS[arch]()
    for field, value in overrides.items():
        setattr(config, field, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model, arch, seed)
    path = root / arch
    model.save_pretrained(path)
    return TinyHF(arch, config, model, path)


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the raw logits ``[max_new, vocab]`` that chose them (HF generate)."""
    # NOTE: no EOS: generation must run max_new steps, and no logits processor may touch the
    # choice (min_new_tokens would mask EOS and pick a different token than the raw argmax).
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits, dim=0).float()
