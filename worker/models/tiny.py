"""The built-in ``tiny`` model: a small random-weight MiMo-V2-Flash, created on first use.

Why MiMo-V2-Flash: it is the only supported architecture whose SWA and full layers differ in KV
head count (SWA has twice as many), and its SWA layers carry attention sinks, so the default
model exercises the hard hybrid cases (unequal per-token KV size in the two pools, sinks, window)
end to end.

Shape: hidden 128, 6 layers (full, SWA ×4, full), 4 query heads, head dim 64 (partial rotary),
KV heads 1 (full) / 2 (SWA), HF ``sliding_window`` 33 (window 32), 4096 positions, float32.
Layer 3 is a small MoE, the rest dense MLPs. The tokenizer is a byte-level BPE trained on
`tiny_corpus.CORPUS`, with bos/eos/pad and a chat template.

Everything is deterministic (fixed seeds, fixed corpus), so every process and machine builds
byte-identical files. The directory is an ordinary HF model dir (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json) that
transformers also loads. Creation is atomic: build in a temporary sibling, then `os.replace`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.models.spec import HFConfig
from worker.models.tiny_corpus import CORPUS

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import GenerationConfig

TINY_VERSION = "tiny-v1"
CACHE_ENV = "SWASERVE_CACHE_DIR"
SEED = 20260601
TOKENIZER_VOCAB = 1024
SLIDING_WINDOW_HF = 33  # window 32 (docs/design.md §1)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def default_cache_root() -> Path:
    """``$SWASERVE_CACHE_DIR``, else ``~/.cache/swaserve``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "swaserve"


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """The tiny model's directory ``<cache root>/models/tiny-v1``, built on first call.

    Args:
        cache_dir: the cache root; default `default_cache_root()`.
    Returns:
        The directory; a second call (from any process) returns the existing one.
    """
    target = Path(cache_dir or default_cache_root()) / "models" / TINY_VERSION
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-", dir=target.parent))
    try:
        build_tiny_model(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process won the race (the target is now a non-empty directory).
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _FILES)


def build_tiny_model(out_dir: Path) -> None:
    """Write the tokenizer, config and weights into `out_dir` (deterministic)."""
    tokenizer = _train_tokenizer()
    vocab = tokenizer.get_vocab_size()
    config = _config(vocab, tokenizer)
    _save_tokenizer(tokenizer, out_dir)
    config.save_pretrained(out_dir)
    _generation_config(tokenizer).save_pretrained(out_dir)
    _save_weights(config, out_dir)


# ---- tokenizer ----------------------------------------------------------------------------------
def _train_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tok


def _save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _generation_config(tok: Tokenizer) -> GenerationConfig:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
    )


# ---- model --------------------------------------------------------------------------------------
def _config(vocab: int, tok: Tokenizer) -> HFConfig:
    from transformers import MiMoV2FlashConfig

    layer_types = ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]
    return MiMoV2FlashConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,  # SWA layers get 2
        head_dim=64,
        v_head_dim=64,
        moe_intermediate_size=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW_HF,
        max_position_embeddings=4096,
        layer_types=layer_types,
        mlp_layer_types=["dense", "dense", "dense", "sparse", "dense", "dense"],
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        dtype="float32",
    )


def _save_weights(config: HFConfig, out_dir: Path) -> None:
    from safetensors.torch import save_file

    from worker.models.hf_config import spec_from_hf_config
    from worker.models.loader import build_model

    model = build_model(config, spec_from_hf_config(config), dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(SEED)
    state = {}
    for name, t in model.state_dict().items():
        state[name] = _init(name, t, gen)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _init(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Scales that give peaked (not uniform) next-token distributions from random weights."""
    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("e_score_correction_bias"):
        return 0.1 * noise
    if t.dim() == 1:  # sinks
        return noise
    if "embed_tokens" in name:
        return noise
    return noise * t.shape[-1] ** -0.5 * (2.0 if name == "lm_head.weight" else 1.0)
