"""The logit controls the sampler applies before temperature, each one vectorised over the rows
that use it (docs/design.md §4.1): logit bias, banned tokens (min_tokens), presence/frequency/
repetition penalties, and the grammar's token bitmask.

Token histories arrive as Python lists (they live with each request); each control packs the
rows that need it into one padded tensor and scatters, so a step costs a fixed number of tensor
ops whatever the batch holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[Sequence[tuple[int, float]]]) -> None:
    """Add each row's (token id, bias) pairs in place; ids beyond the vocabulary are ignored."""
    vocab = logits.shape[-1]
    r, t, b = [], [], []
    for row, pairs in zip(rows, biases):
        for token, bias in pairs:
            if 0 <= token < vocab:
                r.append(row)
                t.append(token)
                b.append(float(bias))
    if r:
        dev = logits.device
        index = (torch.tensor(r, device=dev), torch.tensor(t, device=dev))
        logits.index_put_(index, torch.tensor(b, device=dev), accumulate=True)


def apply_banned(logits: torch.Tensor, rows: list[int], banned: list[Sequence[int]]) -> None:
    """Tokens a row may not pick this step (min_tokens: EOS and stop ids) get -inf, in place."""
    vocab = logits.shape[-1]
    pairs = [(row, t) for row, ts in zip(rows, banned) for t in ts if 0 <= t < vocab]
    if pairs:
        r, t = zip(*pairs)
        dev = logits.device
        logits[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")


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
