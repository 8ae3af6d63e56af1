"""How a model's chats become prompt tokens and its output becomes a message: the chat template
plus a tool-call parser (`TemplateChat`), or harmony for GPT-OSS (`deploy.openai.harmony`)."""

from __future__ import annotations

from typing import Any, Protocol

from core.sampling_params import Grammar
from deploy.openai.prompts import PromptBuilder
from deploy.openai.schema import ChatCompletionRequest
from deploy.openai.tools import ChatParser, chat_parser, check_tools, tool_grammar


class ChatFormat(Protocol):
    stop_token_ids: tuple[int, ...]  # added to every chat request's stop tokens

    def prompt(self, req: ChatCompletionRequest) -> list[int]: ...

    def parser(self, req: ChatCompletionRequest) -> ChatParser: ...

    def grammar(self, req: ChatCompletionRequest) -> Grammar | None:
        """The grammar tool_choice imposes (required / named), or None."""
        ...


class TemplateChat:
    def __init__(self, tokenizer: Any, model_type: str) -> None:
        self._prompts = PromptBuilder(tokenizer)
        self._model_type = model_type
        self.stop_token_ids: tuple[int, ...] = ()

    def prompt(self, req: ChatCompletionRequest) -> list[int]:
        check_tools(req)
        return self._prompts.chat(req)

    def parser(self, req: ChatCompletionRequest) -> ChatParser:
        return chat_parser(req, self._model_type)

    def grammar(self, req: ChatCompletionRequest) -> Grammar | None:
        return tool_grammar(req)


def chat_format_for(tokenizer: Any, model_dir: str | None) -> ChatFormat:
    """Harmony for GPT-OSS model directories, the chat template for everything else."""
    model_type = _model_type(model_dir)
    if model_type == "gpt_oss":
        from deploy.openai.harmony import HarmonyChat

        return HarmonyChat(tokenizer, model_dir)
    return TemplateChat(tokenizer, model_type)


def _model_type(model_dir: str | None) -> str:
    import json
    from pathlib import Path

    if model_dir is None:
        return ""
    try:
        return str(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""
