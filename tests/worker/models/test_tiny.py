"""The built-in tiny model: deterministic, atomic, an ordinary HF dir, hard hybrid cases, parity."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from tests.worker.models.driver import Driver
from worker.models.hf_config import load_spec
from worker.models.loader import load_model
from worker.models.spec import LayerKind
from worker.models.tiny import CACHE_ENV, TINY_VERSION, ensure_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_layout_and_second_call_reuses(tiny_dir: Path) -> None:
    """An HF dir under <root>/models/tiny-v1; a second call returns it untouched."""
    assert tiny_dir.name == TINY_VERSION and tiny_dir.parent.name == "models"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert ensure_tiny_model(tiny_dir.parent.parent) == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


def test_env_var_sets_the_cache_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """$SWASERVE_CACHE_DIR is the default root (pre-seeded here to skip a rebuild)."""
    import shutil

    shutil.copytree(tiny_dir, tmp_path / "models" / TINY_VERSION)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert ensure_tiny_model() == tmp_path / "models" / TINY_VERSION


def test_concurrent_builds_agree_and_are_deterministic(tmp_path: Path, tiny_dir: Path) -> None:
    """Two racing builders leave one complete dir, byte-identical to an independent build."""
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "models" / TINY_VERSION] * 2
    assert _digests(results[0]) == _digests(tiny_dir)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [TINY_VERSION], (
        "temp dirs left behind"
    )


def test_spec_has_the_hard_cases(tiny_dir: Path) -> None:
    """SWA and full layers with different KV head counts; sinks on SWA; window 32."""
    spec = load_spec(tiny_dir)
    assert spec.architecture == "mimo_v2_flash" and spec.is_hybrid
    assert spec.window == 32
    assert spec.swa.num_kv_heads != spec.full.num_kv_heads
    assert spec.swa.has_sinks and not spec.full.has_sinks
    assert LayerKind.FULL in spec.layer_kinds and spec.layer_kinds.count(LayerKind.SWA) >= 2


def test_tokenizer_roundtrip_and_chat_template(tiny_dir: Path) -> None:
    """Byte-level BPE round-trips any text; the chat template tags roles and adds the prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert 512 <= len(tok) <= 1024
    assert None not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    text = "Hello, world! Ünïcode ✓ 🙂 12345"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"


def test_runner_matches_transformers_on_tiny(tiny_dir: Path) -> None:
    """HF loads the dir as is; our runner's greedy tokens and logits equal its eager output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    spec = load_spec(tiny_dir)
    drv = Driver(spec, load_model(tiny_dir, spec), page_size=16, chunk=24, free_swa=True)
    prompt = list(range(10, 90))  # 80 tokens: > 2 windows
    seq = drv.add(prompt, 16)
    drv.run([seq])
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert seq.out == out.sequences[0, len(prompt) :].tolist()
    assert (torch.stack(seq.logits) - torch.cat(out.logits)).abs().max() < 1e-4
    assert torch.stack(seq.logits).std() > 1.0, "tiny's logits should be peaked, not uniform"
