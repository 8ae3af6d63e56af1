"""Prompt text -> token ids: the Rust tokenizer called directly gives the ids the tokenizer's
own call gives, and the shortcut steps aside whenever the backend's state or the class differs."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.openai.prompts import PromptBuilder, backend_encoder
from tests.fakes.tokenizer import make_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _reference(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.one_of(st.text(max_size=24), st.sampled_from(["<s>", "</s>", " ", "\n", "é", "😀"])),
                       min_size=1, max_size=8),
       add_special_tokens=st.booleans())  # fmt: skip
def test_the_rust_encoder_gives_the_tokenizers_ids(tokenizer: Any, pieces: list[str], add_special_tokens: bool) -> None:
    """Any text, special tokens' text among it, with and without special tokens added."""
    builder = PromptBuilder(tokenizer)
    assert builder._backend is tokenizer.backend_tokenizer
    text = "".join(pieces) + "".join(tokenizer.all_special_tokens[:2])
    assert builder._encode(text, add_special_tokens) == _reference(tokenizer, text, add_special_tokens)


class _Spy:
    """A backend that records which of its encoders was called."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("encode"):
            self.calls.append(name)
        return getattr(self._backend, name)


def test_the_encoder_that_releases_the_gil_is_the_one_called(tokenizer: Any) -> None:
    """`encode_batch` lets the event loop run while a long prompt is encoded on the pool (the
    Rust `encode` holds the GIL throughout): the shortcut calls only it."""
    builder = PromptBuilder(tokenizer)
    spy = builder._backend = _Spy(tokenizer.backend_tokenizer)
    assert builder._encode("a prompt") == _reference(tokenizer, "a prompt", True)
    assert spy.calls == ["encode_special_tokens", "encode_batch"]


def test_a_backend_left_truncating_is_not_used_as_it_is(tokenizer: Any) -> None:
    """A truncation set on the backend (by someone's call with `truncation=`) would cut the
    prompt; the call goes through the tokenizer, which clears it, and the next one is direct."""
    builder = PromptBuilder(tokenizer)
    text = "sliding windows over a long prompt " * 8
    whole = _reference(tokenizer, text, True)
    tokenizer.backend_tokenizer.enable_truncation(4)
    try:
        assert builder._encode(text) == whole and len(whole) > 4
        assert tokenizer.backend_tokenizer.truncation is None  # the tokenizer's call cleared it
        assert builder._encode(text) == whole
    finally:
        tokenizer.backend_tokenizer.no_truncation()


def test_split_special_tokens_is_followed(tokenizer: Any) -> None:
    """With `split_special_tokens`, special tokens' text is split like any text: the backend's
    flag must match before the shortcut is taken."""
    builder = PromptBuilder(tokenizer)
    text = f"a {tokenizer.all_special_tokens[0]} b"
    whole = _reference(tokenizer, text, False)
    tokenizer.split_special_tokens = True
    try:
        split = builder._encode(text, False)
        assert split == _reference(tokenizer, text, False) and split != whole
        assert builder._encode(text, False) == split  # now with the backend's flag set to match
    finally:
        tokenizer.split_special_tokens = False
        tokenizer(text)  # the backend's flag back
    assert builder._encode(text, False) == whole


def test_a_class_with_its_own_encoding_keeps_it(tokenizer: Any) -> None:
    """A tokenizer class that overrides how it encodes is called as it is."""
    cls = type(tokenizer)

    class Marking(cls):  # type: ignore[misc, valid-type]
        def _encode_plus(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._encode_plus(*args, **kwargs)
            out["input_ids"] = [*out["input_ids"], 0]
            return out

    marking = Marking.__new__(Marking)
    marking.__dict__.update(tokenizer.__dict__)
    assert backend_encoder(marking) is None
    assert PromptBuilder(marking)._encode("hello") == [*_reference(tokenizer, "hello", True), 0]
    assert backend_encoder(object()) is None

    class Modal(cls):  # type: ignore[misc, valid-type]
        def _switch_to_input_mode(self) -> None:  # sets the backend's special tokens per mode
            pass

    modal = Modal.__new__(Modal)
    modal.__dict__.update(tokenizer.__dict__)
    assert backend_encoder(modal) is None
