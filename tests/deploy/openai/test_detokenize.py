"""Incremental detokenization and stop strings at the ingress: equal to a full decode on text,
linear in the tokens whatever they are."""

from __future__ import annotations

from typing import Any

import pytest

from deploy.openai.detokenize import CONTEXT, MAX_HELD, IncrementalDetokenizer, StopTextStream
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


MIXED = "Naïve café — 中文字符测试, 😀😀 emoji; ✓✓ done. Ünïcödé " * 6


@pytest.mark.parametrize("sizes", [[1], [7, 1, 1, 2], [40, 1], [1, 3, 25]])
def test_pushes_of_any_size_equal_the_full_decode(tokenizer: Any, sizes: list[int]) -> None:
    """Multi-byte text pushed in chunks of varying size (bigger than the kept context too)
    comes out exactly as a full decode, no replacement character ever emitted."""
    ids = tokenizer(MIXED)["input_ids"]
    detok, pieces, i, k = IncrementalDetokenizer(tokenizer, [5, 6]), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        pieces.append(detok.push(ids[i : i + n], final=i + n >= len(ids)))
        i, k = i + n, k + 1
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


class CountingTokenizer:
    """A tokenizer that counts its decode calls and the tokens they decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls, self.tokens = tokenizer, 0, 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.calls += 1
        self.tokens += len(ids)
        return str(self.tokenizer.decode(ids, **kw))


def test_a_run_of_byte_tokens_costs_linear_work(tokenizer: Any) -> None:
    """2,000 tokens that never complete a character (a UTF-8 continuation byte, as a logit_bias
    can force) cost O(n): about two decodes per push, of a bounded window each; their text comes
    out as it goes (replacement characters), at least every MAX_HELD tokens."""
    continuation = tokenizer("é")["input_ids"][-1]
    counting, n = CountingTokenizer(tokenizer), 2000
    detok = IncrementalDetokenizer(counting, [5, 6, 7])
    pieces = [detok.push([continuation]) for _ in range(n)]
    assert counting.calls <= 3 * n
    assert counting.tokens <= 2 * (CONTEXT + MAX_HELD) * n
    assert sum(1 for p in pieces if p) >= n // MAX_HELD and set("".join(pieces)) == {"\ufffd"}


def test_stop_search_keeps_only_the_held_back_tail(tokenizer: Any) -> None:
    """A long output with stop strings that never appear: the text matches a full decode, and
    the stream keeps (and searches) only the held-back tail plus the newest text."""
    ids = tokenizer(MIXED * 4)["input_ids"]
    stream = StopTextStream(tokenizer, ["<never>", "zz top"])
    out = ""
    for i, t in enumerate(ids):
        out += stream.feed([t], final=i == len(ids) - 1).text
        assert len(stream._buf) <= 2 * len("<never>") + 8
    assert out == stream.text == tokenizer.decode(ids) and not stream.stopped


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decoder_gives_the_tokenizers_text(tokenizer: Any, skip: bool) -> None:
    """A fast tokenizer is decoded by its Rust backend (no transformers layers per push); every
    piece equals what decoding through the tokenizer gives, special tokens skipped or not."""
    from deploy.openai.detokenize import backend_decoder

    assert backend_decoder(tokenizer) is tokenizer.backend_tokenizer
    assert backend_decoder(CountingTokenizer(tokenizer)) is None
    special = [tokenizer.all_special_ids[0]] if tokenizer.all_special_ids else []
    ids = tokenizer(MIXED)["input_ids"] + special + tokenizer(" tail")["input_ids"]
    fast = IncrementalDetokenizer(tokenizer, [5, 6], skip_special_tokens=skip)
    slow = IncrementalDetokenizer(CountingTokenizer(tokenizer), [5, 6], skip_special_tokens=skip)
    assert fast._tok is tokenizer.backend_tokenizer
    for i in range(0, len(ids), 3):
        chunk, final = ids[i : i + 3], i + 3 >= len(ids)
        assert fast.push(chunk, final) == slow.push(chunk, final)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer: Any) -> None:
    """`clean_up_tokenization_spaces` changes the text after the Rust decode: no fast path."""
    from deploy.openai.detokenize import backend_decoder

    before = tokenizer.clean_up_tokenization_spaces
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert backend_decoder(tokenizer) is None
    finally:
        tokenizer.clean_up_tokenization_spaces = before
