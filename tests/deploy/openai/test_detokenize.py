"""Incremental detokenization and stop strings at the ingress."""

from __future__ import annotations

from typing import Any

import pytest

from deploy.openai.detokenize import IncrementalDetokenizer, StopTextStream
from tests.fakes.tokenizer import make_tokenizer_dir

TEXT = "Héllo wörld — 😀 sliding windows ✓ done."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_decode_matches_full_decode(tokenizer: Any, step: int) -> None:
    """Feeding tokens k at a time yields exactly the full decode, never a split character."""
    ids = tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i : i + step], final=i + step >= len(ids)) for i in range(0, len(ids), step)]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_token_boundaries_is_never_leaked(tokenizer: Any) -> None:
    """A stop string spanning tokens is cut; no emitted piece contains any part of it."""
    ids = tokenizer(TEXT)["input_ids"]
    stream = StopTextStream(tokenizer, ["sliding win"])
    pieces = []
    for i, t in enumerate(ids):
        piece = stream.feed([t], final=i == len(ids) - 1)
        pieces.append(piece.text)
        if piece.stopped:
            break
    assert stream.stopped and "".join(pieces) == TEXT[: TEXT.index("sliding win")]


def test_held_back_tail_is_released_at_the_end(tokenizer: Any) -> None:
    """Text that merely looks like a stop-string prefix comes out when the request finishes."""
    ids = tokenizer("abc sli")["input_ids"]
    stream = StopTextStream(tokenizer, ["sliding"])
    out = "".join(stream.feed([t], final=i == len(ids) - 1).text for i, t in enumerate(ids))
    assert out == "abc sli" and not stream.stopped


@pytest.mark.parametrize("step", [1, 4, 100])
def test_stop_strings_count_after_min_tokens_and_can_be_kept(tokenizer: Any, step: int) -> None:
    """A stop string inside the first min_tokens tokens is text; the next one cuts (kept with
    include_stop)."""
    ids = tokenizer("ab. cd. ef.")["input_ids"]
    first_dot = next(i for i in range(len(ids)) if "." in tokenizer.decode(ids[: i + 1]))

    def run(**kw: Any) -> str:
        stream, out = StopTextStream(tokenizer, ["."], **kw), ""
        for i in range(0, len(ids), step):
            out += stream.feed(ids[i : i + step], final=i + step >= len(ids)).text
        return out

    assert run() == "ab"
    assert run(min_tokens=first_dot + 1) == "ab. cd"
    assert run(min_tokens=first_dot + 1, include_stop=True) == "ab. cd."
