"""Prompts -> token ids at the ingress (workers only ever see token ids).

`/v1/completions` takes text (tokenized with the tokenizer's special tokens, e.g. BOS, as vLLM
does), token ids, or a batch of either; `/v1/chat/completions` renders the tokenizer's chat
template (tools, tool calls, `chat_template_kwargs`; the generation prompt unless asked not to)
and tokenizes the result without adding special tokens again. GPT-OSS renders harmony instead
(`deploy.openai.harmony`).
"""

from __future__ import annotations

from typing import Any

from deploy.openai.detokenize import rust_backend
from deploy.openai.limits import parse_json
from deploy.openai.schema import ChatCompletionRequest, ChatMessage, bad_request

MAX_BATCH = 16  # prompts per /v1/completions request


def backend_encoder(tokenizer: Any) -> Any | None:
    """The Rust tokenizer whose `encode_batch([text], add_special_tokens=f)[0].ids` are the ids
    `tokenizer(text, add_special_tokens=f)` gives, when there is one: a fast tokenizer whose
    class keeps transformers' own `__call__` and `_encode_plus` (which set no truncation or
    padding for such a call and pass the text to the backend as it is). That call skips
    transformers' Python layers (argument handling, strategies, the `BatchEncoding`): ~0.14 ms
    instead of ~0.22–0.33 for a 32-token prompt here, once per request. Whether the backend's
    state still matches is checked per call (`PromptBuilder._encode`). Else None; also for a class with
    source and target modes (`_switch_to_input_mode`: the call sets the backend's special tokens
    per mode first)."""
    if hasattr(tokenizer, "_switch_to_input_mode"):
        return None
    return rust_backend(tokenizer, "__call__", "_encode_plus")


class PromptBuilder:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._vocab = len(tokenizer)
        self._backend = backend_encoder(tokenizer)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        b = self._backend
        # The backend's state is the tokenizer's to set (a call with truncation, padding or
        # `split_special_tokens` elsewhere in the process leaves it set): only the state a
        # plain call would leave takes the shortcut.
        if (
            b is not None
            and b.truncation is None
            and b.padding is None
            and b.encode_special_tokens == bool(self._tok.split_special_tokens)
        ):
            # NOTE: `encode_batch`, as transformers calls it: it releases the GIL while it
            # encodes (`encode` holds it), so a long prompt on the pool never stalls the loop.
            return list(b.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        if add_special_tokens:  # the call's default: as any tokenizer-like object takes it
            return list(self._tok(text)["input_ids"])
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

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
                ids = self._encode(item)
            else:
                ids = list(item)
            self._check_ids(ids, param)
            out.append(ids)
        return out

    def chat(self, req: ChatCompletionRequest) -> list[int]:
        """The chat template over the messages (with tools, assistant tool calls, tool results
        and `chat_template_kwargs`), then tokenized without adding special tokens again."""
        if not getattr(self._tok, "chat_template", None):
            raise bad_request(
                "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
            raise bad_request(
                "continue_final_message needs add_generation_prompt=false and a last assistant message",
                param="continue_final_message",
            )
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
        if reserved & set(kwargs):
            raise bad_request(f"chat_template_kwargs may not set {sorted(reserved & set(kwargs))}",
                              param="chat_template_kwargs")  # fmt: skip
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self._tok.apply_chat_template(
                [_as_dict(m) for m in req.messages], tools=tools, tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **kwargs,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - templates raise on e.g. bad role order
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from None
        ids = self._encode(text, add_special_tokens=False)
        self._check_ids(ids, "messages")
        return ids

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("prompt is empty; send text or token ids", param=param)
        bad = next((t for t in ids if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self._vocab})", param=param)


def _as_dict(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        d["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        # Templates read the arguments as a mapping (`| tojson`); clients send a JSON string.
        d["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    return d


def _arguments(text: str) -> Any:
    try:
        return parse_json(text)
    except ValueError:  # not JSON (or nested too deep): the template gets the text
        return text
