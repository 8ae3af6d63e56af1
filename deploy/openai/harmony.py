"""GPT-OSS chats in the harmony format, through `openai-harmony` (docs/design.md §4.2).

Prompt: a system message (reasoning effort from `reasoning_effort`), a developer message with
the instructions (system/developer messages of the request) and the function tools, then the
conversation: user turns, assistant turns (`reasoning_content` on the analysis channel, content
on final, `tool_calls` as commentary messages to `functions.NAME`), tool results as messages
from `functions.NAME` (found through `tool_call_id`). Generation stops at `<|return|>` or
`<|call|>`.

Output: the token ids go through harmony's streaming parser: the analysis channel becomes
`reasoning_content`, final becomes `content`, a message to `functions.NAME` becomes a tool call.
Malformed output (a model that ignores the format) ends the parse; what was read stays.

The encoding needs o200k_base's vocabulary file. `TIKTOKEN_ENCODINGS_BASE` may point at a
folder holding `o200k_base.tiktoken`; otherwise it is written once from the model directory's
`tokenizer.json` (same ranks, byte-identical: harmony checks its hash) into the swaserve cache.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.sampling_params import Grammar
from deploy.openai.bodies import ToolCallDelta
from deploy.openai.schema import ChatCompletionRequest, ChatMessage, bad_request
from deploy.openai.tools import ChatParser, ChatPiece, check_tools, tool_grammar

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message, StreamableParser

VOCAB_FILE = "o200k_base.tiktoken"
ENCODINGS_ENV = "TIKTOKEN_ENCODINGS_BASE"
O200K_RANKS = 199_998  # mergeable tokens of o200k_base; ids above are special


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def write_vocab(tokenizer_json: Path, out: Path) -> None:
    """o200k_base's tiktoken file from a byte-level BPE `tokenizer.json` holding its ranks."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    by_rank = {i: t for t, i in vocab.items() if i < O200K_RANKS}
    if len(by_rank) != O200K_RANKS:
        raise ValueError(f"{tokenizer_json} has {len(by_rank)} of o200k_base's {O200K_RANKS} tokens")
    decoder = _byte_decoder()
    lines = (base64.b64encode(bytes(decoder[ch] for ch in by_rank[r])).decode() + f" {r}\n" for r in range(O200K_RANKS))
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, out)


def load_encoding(model_dir: str | None) -> HarmonyEncoding:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    if not os.environ.get(ENCODINGS_ENV) and model_dir is not None:
        from worker.models.tiny import default_cache_root

        folder = default_cache_root() / "harmony"
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / VOCAB_FILE).exists():
            write_vocab(Path(model_dir) / "tokenizer.json", folder / VOCAB_FILE)
        os.environ[ENCODINGS_ENV] = str(folder)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyChat:
    def __init__(self, tokenizer: Any, model_dir: str | None, encoding: HarmonyEncoding | None = None) -> None:
        self._tok = tokenizer
        self.encoding = encoding or load_encoding(model_dir)
        self.stop_token_ids: tuple[int, ...] = tuple(self.encoding.stop_tokens_for_assistant_actions())

    def prompt(self, req: ChatCompletionRequest) -> list[int]:
        from openai_harmony import Conversation, Role

        check_tools(req)
        if req.continue_final_message or not req.add_generation_prompt:
            raise bad_request("GPT-OSS chats always end with a new assistant turn", param="continue_final_message")
        extra = set(req.chat_template_kwargs or {}) - {"reasoning_effort"}
        if extra:
            raise bad_request(f"harmony (GPT-OSS) takes only reasoning_effort here, not {sorted(extra)}",
                              param="chat_template_kwargs")  # fmt: skip
        convo = Conversation.from_messages(self._messages(req))
        return list(self.encoding.render_conversation_for_completion(convo, Role.ASSISTANT))

    def parser(self, req: ChatCompletionRequest) -> ChatParser:
        return HarmonyParser(self.encoding)

    def grammar(self, req: ChatCompletionRequest) -> Grammar | None:
        return tool_grammar(req)

    def _messages(self, req: ChatCompletionRequest) -> list[Message]:
        from openai_harmony import (
            DeveloperContent,
            Message,
            ReasoningEffort,
            Role,
            SystemContent,
            ToolDescription,
        )

        effort_name = req.reasoning_effort or (req.chat_template_kwargs or {}).get("reasoning_effort") or "medium"
        if str(effort_name).upper() not in ReasoningEffort.__members__:
            raise bad_request("reasoning_effort must be low, medium or high", param="chat_template_kwargs")
        effort = ReasoningEffort[str(effort_name).upper()]
        out = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort))]
        instructions = "\n".join(m.text() for m in req.messages if m.role in ("system", "developer"))
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if req.tools and req.tool_choice != "none":
            dev = dev.with_function_tools([
                ToolDescription.new(t.function.name, t.function.description or "", t.function.parameters)
                for t in req.tools
            ])  # fmt: skip
        if instructions or req.tools:
            out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
        names: dict[str, str] = {}  # tool call id -> function name
        for m in req.messages:
            out += self._turn(m, names)
        return out

    def _turn(self, m: ChatMessage, names: dict[str, str]) -> list[Message]:
        from openai_harmony import Author, Message, Role

        if m.role == "user":
            return [Message.from_role_and_content(Role.USER, m.text())]
        if m.role == "tool":
            name = names.get(m.tool_call_id or "", m.name or "")
            if not name:
                raise bad_request("a tool message needs the tool_call_id of an earlier call", param="messages")
            author = Author.new(Role.TOOL, f"functions.{name}")
            return [Message.from_author_and_content(author, m.text()).with_channel("commentary").with_recipient("assistant")]
        if m.role != "assistant":
            return []  # system/developer: the developer message's instructions
        turn = []
        if m.reasoning_content:
            turn.append(Message.from_role_and_content(Role.ASSISTANT, m.reasoning_content).with_channel("analysis"))
        for call in m.tool_calls or []:
            names[call.id] = call.function.name
            turn.append(
                Message.from_role_and_content(Role.ASSISTANT, call.function.arguments).with_channel("commentary")
                .with_recipient(f"functions.{call.function.name}").with_content_type("<|constrain|>json")
            )  # fmt: skip
        if m.text():
            turn.append(Message.from_role_and_content(Role.ASSISTANT, m.text()).with_channel("final"))
        return turn


class HarmonyParser(ChatParser):
    """Streams reasoning, content and tool calls out of harmony tokens."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        from openai_harmony import Role, StreamableParser

        super().__init__()
        self._parser: StreamableParser | None = StreamableParser(encoding, Role.ASSISTANT)
        self._args = ""  # the tool call being read

    def feed(self, text: str, token_ids: list[int]) -> ChatPiece:
        piece = ChatPiece()
        for t in token_ids:
            if self._parser is None:
                break
            recipient_before = self._parser.current_recipient
            try:
                self._parser.process(t)
            except Exception:  # noqa: BLE001 - the model left the format: keep what was read
                self._end_call(recipient_before, piece)
                self._parser = None
                break
            self._route(recipient_before, piece)
        self.content += piece.content
        self.reasoning += piece.reasoning
        return piece

    def _route(self, recipient_before: str | None, piece: ChatPiece) -> None:
        p = self._parser
        assert p is not None
        delta = p.last_content_delta or ""
        if recipient_before and recipient_before != p.current_recipient:
            self._end_call(recipient_before, piece)  # that call's message ended
        if not delta:
            return
        if p.current_recipient and p.current_recipient.startswith("functions."):
            self._args += delta
        elif p.current_channel == "final":
            piece.content += delta
        elif p.current_channel in ("analysis", "commentary"):
            piece.reasoning += delta

    def _end_call(self, recipient: str | None, piece: ChatPiece) -> None:
        if recipient and recipient.startswith("functions.") and self._args:
            call: ToolCallDelta = self._call(recipient.removeprefix("functions."), self._args)
            piece.tool_calls.append(call)
        self._args = ""

    def finish(self) -> ChatPiece:
        piece = ChatPiece()
        if self._parser is not None:
            self._end_call(self._parser.current_recipient, piece)
        return piece
