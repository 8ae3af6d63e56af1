"""Prompts -> token ids at the ingress (workers only ever see token ids).

`/v1/completions` takes text (tokenized with the tokenizer's special tokens, e.g. BOS, as vLLM
does), token ids, or a batch of either; `/v1/chat/completions` renders the tokenizer's chat
template with the generation prompt and tokenizes the result without adding special tokens again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deploy.openai.schema import ChatMessage, bad_request

MAX_BATCH = 16  # prompts per /v1/completions request


class PromptBuilder:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._vocab = len(tokenizer)

    def completion(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif not prompt:
            raise bad_request("prompt is empty; send text or token ids", param="prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if len(items) > MAX_BATCH:
            raise bad_request(f"at most {MAX_BATCH} prompts per request; got {len(items)}", param="prompt")
        out = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt.{i}"
            if isinstance(item, str):
                if not item:
                    raise bad_request("prompt is empty; send text or token ids", param=param)
                ids = list(self._tok(item)["input_ids"])
            else:
                ids = list(item)
            self._check_ids(ids, param)
            out.append(ids)
        return out

    def chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not any(m.text() for m in messages):
            raise bad_request("every message is empty; send some content", param="messages")
        if not getattr(self._tok, "chat_template", None):
            raise bad_request(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        convo = [_as_dict(m) for m in messages]
        try:
            text = self._tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - templates raise on e.g. bad role order
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from None
        ids = list(self._tok(text, add_special_tokens=False)["input_ids"])
        self._check_ids(ids, "messages")
        return ids

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("prompt is empty; send text or token ids", param=param)
        bad = next((t for t in ids if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self._vocab})", param=param)


def _as_dict(m: ChatMessage) -> dict[str, str]:
    d = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    return d
