"""The two generators `swaserve bench engine` times: transformers' `generate` and our `Engine`.

Both decode greedily for exactly `max_new` tokens from the same prompts and weights (float32,
CPU unless told otherwise) and return the generated token ids per prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PAD_ID = 0  # masked out by the attention mask; any id works


@dataclass(frozen=True)
class Timed:
    seconds: float
    tokens: list[list[int]]


class TransformersSide:
    """`model.generate` on a left-padded batch (the way HF batches prompts of unequal length)."""

    def __init__(self, model_dir: Path, attn: str = "auto", device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the bench has its own
        self.attn = _attn_impl(model_dir, attn)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), attn_implementation=self.attn, dtype=torch.float32, local_files_only=True
        ).to(device).eval()  # type: ignore[arg-type]  # fmt: skip  # transformers types .to() oddly
        self.device = torch.device(device)
        # NOTE: no EOS at all instead of min_new_tokens = max_new_tokens: generation still runs
        # exactly max_new_tokens steps, and no logits processor masks EOS, so the greedy choice is
        # the raw argmax - as in our engine with ignore_eos (masking EOS would change tokens).
        # It must be cleared on the model: a None passed to generate() means "model default".
        self.model.generation_config.eos_token_id = None
        self._config = GenerationConfig

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new: int) -> Timed:
        ids, mask = _left_pad(prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        t0 = time.perf_counter()
        generation = self._config(
            do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=PAD_ID
        )
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)
        seconds = time.perf_counter() - t0
        if out.shape[1] - ids.shape[1] != max_new:
            raise RuntimeError(
                f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {max_new}: "
                "something still stops generation early (EOS?)"
            )
        return Timed(seconds, out[:, ids.shape[1] :].tolist())


def _attn_impl(model_dir: Path, attn: str) -> str:
    """'auto': sdpa where the architecture supports it, else eager."""
    if attn != "auto":
        return attn
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.int64)
        mask[i, width - len(p) :] = 1
    return ids, mask


class EngineSide:
    """Our `Engine.generate` (greedy, ignore_eos); the radix cache is flushed after every run so
    that no run reuses the previous one's prefixes."""

    def __init__(
        self, model_dir: Path, batch_size: int, overrides: dict[str, Any] | None = None
    ) -> None:
        from worker.config import EngineConfig
        from worker.engine.engine import Engine

        fields = dict(model=str(model_dir), max_running_requests=max(64, batch_size))
        fields.update(overrides or {})
        self.engine = Engine(EngineConfig(**fields))  # type: ignore[arg-type]

    def generate(self, prompts: Sequence[Sequence[int]], max_new: int) -> Timed:
        from core.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        if any(len(o.token_ids) != max_new for o in outs):
            raise RuntimeError(f"the engine stopped a request before {max_new} tokens")
        if not self.engine.flush_cache():
            raise RuntimeError("the engine is still busy after generate(); cannot flush its cache")
        return Timed(seconds, [o.token_ids for o in outs])

    def pool_peaks(self) -> tuple[int, int, int, int]:
        """(full peak used, full total, SWA peak used, SWA total) in tokens."""
        s = self.engine.stats()
        return s.full.peak_used, s.full.total, s.swa.peak_used, s.swa.total
