"""The logit controls the sampler applies before temperature, each one vectorised over the rows
that use it (docs/design.md §4.1): logit bias, banned tokens (min_tokens), presence/frequency/
repetition penalties, and the grammar's token bitmask.

Token histories arrive as Python lists (they live with each request); each control packs the
rows that need it into one padded tensor and scatters, so a step costs a fixed number of tensor
ops whatever the batch holds. What does not change during a request (its logit bias, the tokens
banned until min_tokens) is turned into tensors once (`RequestTensors`), so a step concatenates
them instead of walking every entry in Python.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from core.sampling_params import SamplingParams


@dataclass
class _Tensors:
    vocab: int = 0
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU int64 token ids, float32 biases
    banned_from: Collection[int] | None = None  # the set `banned` was built from
    banned: torch.Tensor | None = None  # CPU int64 token ids


class RequestTensors:
    """Each request's logit-control tensors, built the first step that needs them and dropped
    when its `SamplingParams` is collected (keyed by the object, which a request keeps)."""

    def __init__(self) -> None:
        self._by_params: dict[int, _Tensors] = {}

    def _entry(self, params: SamplingParams, vocab: int) -> _Tensors:
        key = id(params)
        entry = self._by_params.get(key)
        if entry is None or entry.vocab != vocab:
            entry = self._by_params[key] = _Tensors(vocab)
            # NOTE: runs as the params object dies, before its id can name another object.
            weakref.finalize(params, self._by_params.pop, key, None)
        return entry

    def bias(self, params: SamplingParams, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's (token ids, biases); ids beyond the vocabulary are dropped."""
        entry = self._entry(params, vocab)
        if entry.bias is None:
            pairs = [(t, float(b)) for t, b in params.logit_bias if 0 <= t < vocab]
            tokens, biases = zip(*pairs) if pairs else ((), ())
            entry.bias = (torch.tensor(tokens, dtype=torch.int64), torch.tensor(biases, dtype=torch.float32))
        return entry.bias

    def banned(self, params: SamplingParams, banned: Collection[int], vocab: int) -> torch.Tensor:
        """`banned` (what the row may not pick) as token ids; rebuilt only when the row brings
        another collection object (`SamplingParams.banned_until_min_tokens` keeps it the same)."""
        entry = self._entry(params, vocab)
        if entry.banned is None or entry.banned_from is not banned:
            entry.banned_from = banned
            entry.banned = torch.tensor(sorted(t for t in banned if 0 <= t < vocab), dtype=torch.int64)
        return entry.banned


def _scatter_index(rows: list[int], ids: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for each row's `ids`, on `device`."""
    counts = torch.tensor([len(x) for x in ids])
    row_index = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)
    return row_index.to(device), torch.cat(ids).to(device)


def _padded(lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, L]`` int64 ids (0-padded) and a float ``[R, L]`` 1/0 mask of the real entries."""
    width = max((len(x) for x in lists), default=0) or 1
    ids = torch.zeros(len(lists), width, dtype=torch.int64)
    valid = torch.zeros(len(lists), width, dtype=torch.float32)
    for i, x in enumerate(lists):
        if x:
            ids[i, : len(x)] = torch.as_tensor(list(x), dtype=torch.int64)
            valid[i, : len(x)] = 1.0
    return ids.to(device), valid.to(device)


def _counts(lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: float32 ``[R, vocab]``."""
    ids, valid = _padded(lists, device)
    ids = ids.clamp_(0, vocab - 1)
    return torch.zeros(len(lists), vocab, device=device).scatter_add_(1, ids, valid)


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add each row's bias (`RequestTensors.bias`: token ids, biases) in place."""
    if sum(len(ids) for ids, _ in biases):
        index = _scatter_index(rows, [ids for ids, _ in biases], logits.device)
        values = torch.cat([b for _, b in biases]).to(logits.device)
        logits.index_put_(index, values, accumulate=True)


def apply_banned(logits: torch.Tensor, rows: list[int], banned: list[torch.Tensor]) -> None:
    """Tokens a row may not pick this step (`RequestTensors.banned`: min_tokens holds EOS and
    the stop ids back) get -inf, in place."""
    if sum(len(ids) for ids in banned):
        logits[_scatter_index(rows, banned, logits.device)] = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    outputs: list[Sequence[int]],
    prompts: list[Sequence[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> None:
    """OpenAI's presence/frequency penalties over the generated tokens, and vLLM's repetition
    penalty over prompt + generated tokens, for `rows` of `logits`, in place."""
    vocab, dev = logits.shape[-1], logits.device
    index = torch.tensor(rows, device=dev)
    sub = logits[index]
    counts = _counts(outputs, vocab, dev)
    col = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
    sub -= col(frequency) * counts + col(presence) * (counts > 0).float()
    if any(p != 1.0 for p in repetition):
        seen = (counts > 0) | (_counts(prompts, vocab, dev) > 0)
        rep = col(repetition).expand_as(sub)
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, scaled, sub)
    logits[index] = sub


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Keep only the tokens whose bit is set in ``bitmask [len(rows), ceil(vocab / 32)]`` (int32,
    one bit per token, little-endian within each word); the rest get -inf, in place."""
    vocab, dev = logits.shape[-1], logits.device
    words = bitmask.to(dev, non_blocking=True)
    token = torch.arange(vocab, device=dev)
    allowed = (words[:, token // 32] >> (token % 32)) & 1
    index = torch.tensor(rows, device=dev)
    logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))
