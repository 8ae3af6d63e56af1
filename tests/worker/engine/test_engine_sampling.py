"""Sampling parameters through the engine: stopping (max_tokens, EOS, stop ids, stop strings),
seeded sampling independent of the batch, filters, logprobs, and refusal of invalid values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from core.sampling_params import SamplingParams
from tests.worker.engine.conftest import Oracle, assert_all_free, run_checked, tokens
from tests.worker.models.hf_tiny import hf_greedy
from worker.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("overlap")  # every test with overlap off and on

PROMPT = tokens(30, seed=300)
N = 12
CHAR0 = 0x100  # token i decodes to chr(CHAR0 + i): one printable character per token
SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01)


def _first_new(seq: list[int], start: int) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(seq)) if seq[i] not in seq[:i])


def _save_char_tokenizer(path: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(CHAR0 + i): i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=chr(CHAR0)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


@pytest.fixture(scope="module")
def eos_model(oracle: Oracle, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The oracle's weights with a one-character-per-token tokenizer and an EOS token that its
    greedy continuation of PROMPT emits at index >= 4 (returned with the directory)."""
    path = tmp_path_factory.mktemp("tok_model")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(oracle.path / name, path / name)
    _save_char_tokenizer(path)
    greedy = oracle.greedy(PROMPT, N)
    eos_index = _first_new(greedy, 4)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": greedy[eos_index]}))
    return path, eos_index


def _engine(oracle: Oracle, model: Path | None = None) -> Engine:
    return oracle.engine(**({} if model is None else {"model": str(model)}))


# ---- stopping -----------------------------------------------------------------------------------
def test_max_tokens_gives_length(oracle: Oracle) -> None:
    """Exactly max_tokens tokens, finish reason `length`."""
    engine = _engine(oracle)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert (out.token_ids, out.finish_reason) == (oracle.greedy(PROMPT, N)[:5], "length")
    assert_all_free(engine)


def test_eos_stops_unless_ignored(oracle: Oracle, eos_model: tuple[Path, int]) -> None:
    """The model's EOS ends the request (`stop`, EOS included); ignore_eos runs to max_tokens."""
    path, k = eos_model
    engine = _engine(oracle, path)
    greedy = oracle.greedy(PROMPT, N)
    stopped, ignored = engine.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=N, temperature=0.0),
            SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
        ],
    )
    assert (stopped.token_ids, stopped.finish_reason) == (greedy[: k + 1], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (greedy, "length")
    assert_all_free(engine)


def test_stop_token_ids_stop_even_with_ignore_eos(oracle: Oracle) -> None:
    """The earliest of several stop ids ends the request, whatever ignore_eos says."""
    engine = _engine(oracle)
    greedy = oracle.greedy(PROMPT, N)
    j = _first_new(greedy, 3)
    later = _first_new(greedy, j + 1)
    params = SamplingParams(
        max_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[greedy[later], greedy[j]]
    )
    out = engine.generate([PROMPT], params)[0]
    assert (out.token_ids, out.finish_reason) == (greedy[: j + 1], "stop")
    assert_all_free(engine)


def test_stop_strings(oracle: Oracle, eos_model: tuple[Path, int]) -> None:
    """A stop string ends the request at the token that completes it (across tokens too); the
    earliest of several wins; one that never appears leaves the request to max_tokens."""
    path, _ = eos_model
    engine = _engine(oracle, path)
    greedy = oracle.greedy(PROMPT, N)
    text = "".join(chr(CHAR0 + t) for t in greedy)
    j = next(i for i in range(2, N - 3) if text.find(text[i : i + 2]) == i)  # first occurrence
    late = text[N - 1]
    never = chr(CHAR0 + next(t for t in range(128) if t not in greedy))
    runs = [
        ([text[j : j + 2]], greedy[: j + 2], "stop"),  # spans two tokens
        ([late, text[j : j + 2]], greedy[: j + 2], "stop"),
        ([never], greedy, "length"),
    ]
    outs = engine.generate(
        [PROMPT] * len(runs),
        [
            SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=s)
            for s, _, _ in runs
        ],
    )
    for out, (stop, want, reason) in zip(outs, runs):
        assert (out.token_ids, out.finish_reason) == (want, reason), stop
    assert_all_free(engine)


def test_stop_strings_without_a_tokenizer_are_refused_up_front(oracle: Oracle) -> None:
    """The oracle directory has no tokenizer: a stop string is refused at add time (not in a step)."""
    engine = _engine(oracle)
    with pytest.raises(ValueError, match="stop.*tokenizer"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4, stop=["x"]))
    assert not engine.has_work()
    out = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.token_ids == oracle.greedy(PROMPT, N)[:4]


# ---- seeded sampling ----------------------------------------------------------------------------
def _collect(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    got: dict[str, list[int]] = {}
    rids = [engine.add_request(p, sp, on_delta=lambda d: got.setdefault(d.request_id, []).extend(d.token_ids))
            for p, sp in reqs]  # fmt: skip
    run_checked(engine)
    return [got[r] for r in rids]


def test_same_seed_same_tokens_whatever_the_batch(oracle: Oracle) -> None:
    """A seeded request samples the same tokens alone, twice in one batch, and among other
    (seeded and unseeded) requests; another seed samples differently."""
    engine = _engine(oracle)
    seeded = SamplingParams(max_tokens=N, seed=123, **SAMPLED)
    alone = _collect(engine, [(PROMPT, seeded)])[0]
    others = [(tokens(9 + i, seed=310 + i), SamplingParams(max_tokens=N, seed=i if i % 2 else None, **SAMPLED)) for i in range(4)]  # fmt: skip
    batch = _collect(
        engine, [others[0], (PROMPT, seeded), others[1], (PROMPT, seeded), *others[2:]]
    )
    assert batch[1] == alone and batch[3] == alone
    other_seed = _collect(engine, [(PROMPT, SamplingParams(max_tokens=N, seed=124, **SAMPLED))])[0]
    assert other_seed != alone
    assert alone != oracle.greedy(PROMPT, N)  # the temperature really samples
    assert_all_free(engine)


@pytest.mark.parametrize(
    "filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k", "top_p", "min_p"]
)
def test_each_filter_reaches_the_sampler(oracle: Oracle, filters: dict) -> None:
    """At temperature 1, a filter that keeps only the most likely token reproduces greedy."""
    engine = _engine(oracle)
    out = engine.generate(
        [PROMPT], SamplingParams(max_tokens=N, temperature=1.0, seed=7, **filters)
    )[0]
    assert out.token_ids == oracle.greedy(PROMPT, N)
    assert_all_free(engine)


# ---- logprobs -----------------------------------------------------------------------------------
def test_logprobs_match_transformers(oracle: Oracle) -> None:
    """Chosen-token and top-n logprobs equal log_softmax of transformers' logits; n = 0 gives
    only the chosen token's; None gives none. Streamed deltas carry the same values."""
    engine = _engine(oracle)
    greedy, logits = hf_greedy(oracle.model, PROMPT, 6)
    ref = torch.log_softmax(logits, dim=-1)
    streamed = []
    engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
                       on_delta=lambda d: streamed.extend(d.logprobs or []))  # fmt: skip
    three, zero, none = engine.generate(
        [PROMPT] * 3,
        [SamplingParams(max_tokens=6, temperature=0.0, logprobs=n) for n in (3, 0, None)],
    )
    assert three.token_ids == greedy and none.logprobs is None
    assert streamed == three.logprobs
    for i, (lp, lp0) in enumerate(zip(three.logprobs, zero.logprobs)):
        assert lp.token_id == lp0.token_id == greedy[i] and lp0.top == ()
        assert lp.logprob == pytest.approx(ref[i, greedy[i]].item(), abs=1e-4)
        # NOTE: the two requests share a batch but not a path (one reuses the other's cached
        # prompt, so its prefill is one row): float32 rounding differs by a few ulps (AVX-512).
        assert lp0.logprob == pytest.approx(lp.logprob, abs=1e-5)
        values, ids = ref[i].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist() and lp.top[0][0] == greedy[i]
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert_all_free(engine)


# ---- invalid values -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_tokens", -1), ("max_tokens", 2.5), ("temperature", -0.5), ("temperature", float("nan")),
        ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
        ("seed", "abc"), ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", -1), ("logprobs", 21),
    ],
)  # fmt: skip
def test_invalid_values_are_refused_naming_the_parameter(
    oracle: Oracle, name: str, value: object
) -> None:
    """add_request and generate raise ValueError naming the parameter; nothing is queued."""
    engine = _engine(oracle)
    params = SamplingParams(**{name: value})  # type: ignore[arg-type]
    for call in (
        lambda: engine.add_request(PROMPT, params),
        lambda: engine.generate([PROMPT], params),
    ):
        with pytest.raises(ValueError, match=name):
            call()
    assert not engine.has_work()
