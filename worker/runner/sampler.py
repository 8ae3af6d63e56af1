"""Token sampling: logit controls, greedy, temperature, top-k, top-p, min-p, seeded noise,
logprobs (docs/design.md §4.1).

Every step goes the same way for the whole batch, each stage vectorised over the rows that use
it: logit controls (`worker.runner.logit_controls`: bias, banned tokens, penalties, grammar
bitmask), then greedy rows take the argmax and the others draw with the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)``, equivalent to sampling from ``p``). The noise is a pure
function of each request's key and step (`worker.runner.noise`), so a seeded request yields
the same tokens whatever else shares its batch, on any device.

Logprobs are those of the model's distribution (``log_softmax`` of the raw logits, before the
controls, temperature and filters), as vLLM reports them by default.

A row's failure is that row's (its request ends alone, `SampleOutput.failed`): when sampling the
batch raises, each row is sampled alone — the same tokens, since no row's draw depends on the
others — and the rows that raise again are the failed ones.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from core.outputs import TokenLogprob
from core.sampling_params import SamplingParams
from worker.runner.logit_controls import (
    RequestTensors,
    apply_banned,
    apply_bitmask,
    apply_logit_bias,
    apply_penalties,
)
from worker.runner.noise import exponential_noise

logger = logging.getLogger(__name__)

SAMPLING_FAILED = "sampling failed for this request (its logit controls or sampling filters)"


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What the sampler needs of one request this step (the engine builds it from the request)."""

    params: SamplingParams
    key: int  # the request's noise key (`noise.seed_key`)
    step: int  # tokens generated so far: the draw's counter
    output_ids: Sequence[int] = ()  # for the penalties
    prompt_ids: Sequence[int] = ()  # for the repetition penalty
    banned: Collection[int] = ()  # may not be picked this step (min_tokens: EOS and stop ids)
    masked: bool = False  # its row of the step's grammar bitmask applies


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob, None where the request asked for none
    top_logprobs: list[list[tuple[int, float]] | None]  # top-n (token, logprob), best first
    # Rows with no token to give: every token their controls allow (grammar, bans) has a
    # non-finite logit, so `token_ids` holds a placeholder there that must not be used.
    unsampled: tuple[int, ...] = ()
    # Rows whose sampling raised (row -> why): no token either, a placeholder in `token_ids`.
    failed: dict[int, str] = field(default_factory=dict)


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


def controlled(
    logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None, tensors: RequestTensors
) -> torch.Tensor:
    """`logits` after every row's logit controls (a copy when any applies); `tensors` holds
    what each request's controls need, built once per request."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    banned = [i for i, r in enumerate(rows) if r.banned]
    penal = [i for i, r in enumerate(rows) if r.params.penalized]
    masked = [i for i, r in enumerate(rows) if r.masked]
    if not (biased or banned or penal or masked):
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    if biased:
        apply_logit_bias(out, biased, [tensors.bias(rows[i].params, vocab) for i in biased])
    if banned:
        apply_banned(out, banned, [tensors.banned(rows[i].params, rows[i].banned, vocab) for i in banned])
    if penal:
        p = [rows[i].params for i in penal]
        apply_penalties(
            out, penal, [rows[i].output_ids for i in penal], [rows[i].prompt_ids for i in penal],
            [x.presence_penalty for x in p], [x.frequency_penalty for x in p],
            [x.repetition_penalty for x in p],
        )  # fmt: skip
    if masked:
        assert bitmask is not None, "rows marked masked need the step's bitmask"
        apply_bitmask(out, masked, bitmask[masked])
    return out


class Sampler:
    """Per-request state (history, key, step) arrives in each `SampleRow`; the sampler keeps
    only tensors derived from a request's parameters (`RequestTensors`)."""

    def __init__(self) -> None:
        self._tensors = RequestTensors()

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        """One token per row of ``logits [B, vocab]`` (float32).

        Args:
            logits: model logits, one row per request that samples this step.
            rows: each row's request state and parameters.
            bitmask: int32 ``[B, ceil(vocab / 32)]`` allowed-token bits, read for rows with
                `masked` (the grammar's; CPU or the logits' device).
        Returns:
            Chosen token ids, their logprobs and top-n logprobs where requested.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        try:
            return self._sample(logits, rows, bitmask)
        except Exception:  # noqa: BLE001 - find the row(s) at fault; the others go on
            logger.exception("sampling a batch of %d rows failed; sampling each row alone", len(rows))
            return self._rows_alone(logits, rows, bitmask)

    def _rows_alone(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None
    ) -> SampleOutput:
        outs: list[SampleOutput | None] = []
        for i, row in enumerate(rows):
            try:
                outs.append(self._sample(logits[i : i + 1], [row], None if bitmask is None else bitmask[i : i + 1]))
            except Exception:  # noqa: BLE001 - this row's request ends alone
                logger.exception("sampling row %d failed", i)
                outs.append(None)
        return _joined(outs)

    def _sample(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], bitmask: torch.Tensor | None
    ) -> SampleOutput:
        raw = logits.float()
        work = controlled(raw, rows, bitmask, self._tensors)
        chosen = work.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            chosen[random_rows] = self._draw(work[random_rows], [rows[i] for i in random_rows])
        # NOTE: argmax over a row whose allowed tokens all have -inf (or NaN) logits still returns
        # an index, one the controls forbid; such a row yields no token (one check per step).
        finite = torch.isfinite(work.gather(1, chosen[:, None]))[:, 0]
        return _with_logprobs(raw, chosen, finite, [r.params for r in rows])

    def _draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        logits = logits / _column([p.temperature for p in params], logits.device)
        if any(0 < p.top_k < logits.shape[-1] for p in params):
            logits = _top_k(logits, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            logits = _top_p(logits, [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):
            logits = _min_p(logits, [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        noise = exponential_noise([r.key for r in rows], [r.step for r in rows], probs.shape[-1], logits.device)
        return (probs / noise).argmax(dim=-1)


def _joined(outs: list[SampleOutput | None]) -> SampleOutput:
    """One output from single-row ones (None: that row failed; it gets a placeholder token)."""
    ids = [o.token_ids[0] if o else 0 for o in outs]
    lps = [o.logprobs[0] if o else None for o in outs]
    tops = [o.top_logprobs[0] if o else None for o in outs]
    unsampled = tuple(i for i, o in enumerate(outs) if o is not None and o.unsampled)
    failed = {i: SAMPLING_FAILED for i, o in enumerate(outs) if o is None}
    return SampleOutput(ids, lps, tops, unsampled, failed)


def _with_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, finite: torch.Tensor, params: Sequence[SamplingParams]
) -> SampleOutput:
    ids, ok = torch.stack((chosen, finite.to(chosen.dtype))).tolist()  # one device->host copy
    unsampled = tuple(i for i, good in enumerate(ok) if not good)
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return SampleOutput(ids, [None] * len(ids), [None] * len(ids), unsampled)
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
    return SampleOutput(ids, lps, tops, unsampled)


def token_logprobs(logits: torch.Tensor, next_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """The logprob of ``next_ids[i]`` under row i of ``logits [k, vocab]``, with the row's top
    `top_n` (prompt logprobs: row i is position p, `next_ids[i]` the prompt token at p + 1)."""
    if not next_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_ids), dtype=torch.int64, device=logp.device)
    picked = logp.gather(1, ids[:, None])[:, 0].tolist()
    if top_n:
        vals, tops = logp.topk(top_n, dim=-1)
        pairs = [list(zip(t.tolist(), v.tolist())) for t, v in zip(tops, vals)]
    else:
        pairs = [[] for _ in next_ids]
    return [TokenLogprob(t, lp, tuple(p)) for t, lp, p in zip(next_ids, picked, pairs)]
