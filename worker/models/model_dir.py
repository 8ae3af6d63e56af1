"""What a `model` setting names: the built-in "tiny" or a local HF directory, and its tokenizer.

The one place that turns a `model` value (`EngineConfig.model`, `ServeConfig.model`, `--model`)
into a directory, and the one tokenizer loader (the engine's stop strings and the ingress use
it). swaserve never downloads: anything but "tiny" must be a local directory with config.json.
Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from worker.errors import ConfigError

TINY = "tiny"  # the built-in model (worker.models.tiny), built on first use


class Tokenizer(Protocol):
    """What the engine uses of a transformers tokenizer: decoding, for stop strings."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """The model's local directory; "tiny" is built on first use (then reused).

    Raises:
        ConfigError: not "tiny" and not a directory holding config.json.
    """
    if str(model) == TINY:
        from worker.models.tiny import ensure_tiny_model  # lazy: torch, builds the weights once

        return ensure_tiny_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {str(model)!r} is neither the built-in 'tiny' nor a local directory with a "
            "config.json (weights are loaded from disk only, never from a hub)"
        )
    return path


def load_tokenizer(model_dir: str | os.PathLike[str]) -> Any:
    """The tokenizer of a local model directory (transformers' `AutoTokenizer`, offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
