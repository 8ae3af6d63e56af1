"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The filters run vectorised over the batch. The draw uses the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)``, equivalent to sampling from ``p``): rows whose request has
a seed draw their noise from that request's own `torch.Generator`, so a seeded request yields the
same tokens whatever else shares its batch.

Logprobs are those of the model's distribution (``log_softmax`` of the raw logits, before
temperature and filters), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob, None where the request asked for none
    top_logprobs: list[list[tuple[int, float]] | None]  # top-n (token, logprob), best first


def make_generator(
    params: SamplingParams, device: str | torch.device = "cpu"
) -> torch.Generator | None:
    """A request's own generator when it has a seed (create once per request, keep it)."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=logits.device)
    kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass strictly before it already reaches p (the first token stays).
    before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = before >= _column(ps, logits.device)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _min_p(logits: torch.Tensor, ms: list[float]) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * _column(ms, logits.device)
    return logits.masked_fill(probs < floor, float("-inf"))


def _exponential_noise(
    shape: torch.Size, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is None:
            continue
        if gen.device == noise.device:
            noise[row].exponential_(generator=gen)
        else:
            # A CPU generator for a GPU batch: draw where the generator lives, then copy. Also
            # keeps a seed's samples identical across devices.
            row_noise = torch.empty(shape[-1], dtype=torch.float32, device=gen.device)
            noise[row] = row_noise.exponential_(generator=gen).to(device)
    return noise


class Sampler:
    """Stateless: per-request randomness lives in the generators the caller keeps."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SampleOutput:
        """One token per row of ``logits [B, vocab]`` (float32) for ``params[i]``.

        Args:
            logits: model logits, one row per request that samples this step.
            params: each row's sampling parameters.
            generators: each row's generator (from `make_generator`), or None for the global RNG.
        Returns:
            Chosen token ids, their logprobs and top-n logprobs where requested.
        """
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(params)} sampling params")
        gens = list(generators) if generators is not None else [None] * len(params)
        logits = logits.float()
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            chosen[random_rows] = self._draw(
                logits[random_rows],
                [params[i] for i in random_rows],
                [gens[i] for i in random_rows],
            )
        return _with_logprobs(logits, chosen, params)

    def _draw(
        self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> torch.Tensor:
        logits = logits / _column([p.temperature for p in params], logits.device)
        if any(0 < p.top_k < logits.shape[-1] for p in params):
            logits = _top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = _top_p(logits, [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            logits = _min_p(logits, [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        noise = _exponential_noise(probs.shape, gens, logits.device)
        return (probs / noise).argmax(dim=-1)


def _with_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]
) -> SampleOutput:
    ids = chosen.tolist()
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return SampleOutput(ids, [None] * len(ids), [None] * len(ids))
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, chosen[:, None])[:, 0].tolist()
    n_max = max(n or 0 for n in wanted)
    top_vals, top_ids = logp.topk(n_max, dim=-1) if n_max else (None, None)
    lps: list[float | None] = []
    tops: list[list[tuple[int, float]] | None] = []
    for row, n in enumerate(wanted):
        lps.append(None if n is None else picked[row])
        if n is None or top_ids is None or top_vals is None:
            tops.append(None if n is None else [])
            continue
        tops.append(list(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist())))
    return SampleOutput(ids, lps, tops)
