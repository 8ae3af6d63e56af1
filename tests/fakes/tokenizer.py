"""A small byte-level BPE tokenizer with a chat template, saved as a Hugging Face directory.

For ingress tests that need real tokenization but no model: byte-level BPE covers every UTF-8
string (multi-byte characters span several tokens, which exercises incremental detokenization).
"""

from __future__ import annotations

from pathlib import Path

# Tools and tool calls in the Hermes style (what TemplateChat's default parser reads back).
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Sliding window attention keeps only the recent keys. " * 4,
    "Hello world! How are you today? Fine, thanks. " * 4,
    "0123456789 ,.;:!?-_()[]{}<>/\\'\" " * 4,
]


def make_tokenizer_dir(path: Path, vocab_size: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|developer|>", "<|tool|>"]  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path
