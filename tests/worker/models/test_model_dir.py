"""`model` → directory and tokenizer: the one resolver every layer calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.errors import ConfigError
from worker.models.model_dir import TINY, resolve_model_dir


def test_tiny_resolves_to_the_built_in_model_directory() -> None:
    """'tiny' names the built-in model's directory (built once), with its config.json."""
    from worker.models.tiny import ensure_tiny_model

    assert resolve_model_dir(TINY) == ensure_tiny_model()
    assert (resolve_model_dir(TINY) / "config.json").is_file()


def test_a_local_directory_needs_config_json(tmp_path: Path) -> None:
    """A directory without config.json is refused with a message that names it; one with it is kept."""
    with pytest.raises(ConfigError, match="never from a hub") as info:
        resolve_model_dir(tmp_path)
    assert str(tmp_path) in str(info.value)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
