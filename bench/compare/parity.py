"""Greedy text of a few prompts on each server and from transformers, for `vllm-compare`.

The prompts are random tokens (fixed seed) of lengths on both sides of the sliding window (the
comparison model's window is 128), drawn from the tokens that decode to printable ASCII, sent as
token-id prompts to `/v1/completions` with temperature 0 and `ignore_eos`, not streamed.
transformers runs the same ids through a plain greedy loop (its KV cache, no EOS stop, as
`ignore_eos`) and decodes the new ids with `skip_special_tokens`, as both servers do.

NOTE: a random model emits lone bytes of multi-byte UTF-8 characters. Where the completion
ends inside such a character, vLLM leaves the incomplete character out of the final text while
swaserve and transformers show U+FFFD, so texts are compared without trailing U+FFFD. (The
prompts are ASCII because vLLM 0.32 prepends decoded prompt text to a completion whose
token-id prompt ends inside a character.)
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_LENGTHS = (40, 150, 300)
SEED = 4321
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class ParityResult:
    prompt_lengths: tuple[int, ...]
    max_tokens: int
    texts: dict[str, tuple[str, ...]]  # source ("transformers", "vllm", "swaserve") -> texts

    def agree(self, a: str, b: str) -> int:
        """Prompts whose texts from sources `a` and `b` are identical (see the NOTE above)."""

        return sum(
            comparable(x) == comparable(y)
            for x, y in zip(self.texts[a], self.texts[b], strict=True)
        )


def comparable(text: str) -> str:
    return text.rstrip(_REPLACEMENT)


def parity_prompts(model_dir: Path, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Random prompts of `lengths` tokens, each token one that decodes to printable ASCII."""
    import torch
    from transformers import AutoTokenizer

    ids = plain_token_ids(AutoTokenizer.from_pretrained(str(model_dir)))
    gen = torch.Generator().manual_seed(SEED)
    return [[ids[j] for j in torch.randint(0, len(ids), (n,), generator=gen).tolist()] for n in lengths]


def plain_token_ids(tok: Any) -> list[int]:
    """The ids of a tokenizer whose tokens decode to printable ASCII (not only spaces)."""
    return [i for i in range(len(tok)) if _plain(str(tok.decode([i])))]


def _plain(text: str) -> bool:
    return bool(text.strip()) and text.isascii() and text.isprintable()


def server_texts(
    url: str, model: str, prompts: Sequence[list[int] | str], max_tokens: int
) -> tuple[str, ...]:
    """Each prompt's greedy completion from the server: token ids, or text it tokenizes."""
    return tuple(_complete(url, model, prompt, max_tokens) for prompt in prompts)


def _complete(url: str, model: str, prompt: list[int] | str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback
        return str(json.loads(r.read())["choices"][0]["text"])


def transformers_texts(
    model_dir: Path, prompts: list[list[int]], max_tokens: int
) -> tuple[str, ...]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return tuple(
        str(tok.decode(_greedy(model, ids, max_tokens), skip_special_tokens=True))
        for ids in prompts
    )


def _greedy(model: object, ids: list[int], max_tokens: int) -> list[int]:
    import torch

    out: list[int] = []
    with torch.no_grad():
        step = model(input_ids=torch.tensor([ids]), use_cache=True)  # type: ignore[operator]
        for _ in range(max_tokens):
            out.append(int(step.logits[0, -1].argmax()))
            if len(out) == max_tokens:
                break
            # transformers >= 5.2x names the KV cache `cache` (was `past_key_values`)
            step = model(input_ids=torch.tensor([[out[-1]]]), cache=step.cache, use_cache=True)  # type: ignore[operator]
    return out
