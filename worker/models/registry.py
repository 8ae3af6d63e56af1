"""HF ``model_type`` → model class. Classes import lazily: only the one in use loads."""

from __future__ import annotations

import importlib
from typing import cast

from worker.models.causal_lm import Architecture

_REGISTRY: dict[str, str] = {
    "gpt_oss": "worker.models.gpt_oss:GptOssForCausalLM",
    "mimo_v2_flash": "worker.models.mimo_v2_flash:MiMoV2FlashForCausalLM",
    "gemma2": "worker.models.gemma:Gemma2ForCausalLM",
    "gemma3_text": "worker.models.gemma:Gemma3ForCausalLM",
    "gemma3": "worker.models.gemma:Gemma3ForConditionalGeneration",  # text only
    "mistral": "worker.models.mistral:MistralForCausalLM",
    "qwen2": "worker.models.mistral:Qwen2ForCausalLM",
    "cohere2": "worker.models.cohere2:Cohere2ForCausalLM",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def model_class(model_type: str) -> Architecture:
    """The class implementing HF ``model_type``; ValueError listing the supported ones otherwise."""
    target = _REGISTRY.get(model_type)
    if target is None:
        hint = (
            " (use the text-only config: model_type gemma3_text)" if model_type == "gemma3" else ""
        )
        raise ValueError(
            f"model_type {model_type!r} is not supported{hint}; supported: "
            f"{', '.join(supported_model_types())}"
        )
    module, name = target.split(":")
    return cast(Architecture, getattr(importlib.import_module(module), name))
