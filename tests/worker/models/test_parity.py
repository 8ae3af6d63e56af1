"""Greedy tokens and logits of our runner vs transformers (eager), same weights, float32.

Every architecture runs every mode at one page size; the SWA-reuse mode, which is where a wrong
window or a wrong translation shows, runs the sink-carrying hybrids at page sizes 1, 4 and 16.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.models.conftest import Arch, Archs, prompt_of
from tests.worker.models.driver import Driver, Seq
from tests.worker.models.hf_tiny import ARCHS

MAX_NEW = 32
ATOL = 1e-4


def _ceil(x: int, p: int) -> int:
    return -(-x // p) * p


def check_against_hf(arch: Arch, seq: Seq) -> None:
    ref_tokens, ref_logits = arch.reference(tuple(seq.prompt), seq.max_new)
    ours = torch.stack(seq.logits)
    assert ref_logits.std() > 0.3, "degenerate oracle: logits nearly uniform"
    diff = (ours - ref_logits).abs().max().item()
    assert seq.out == ref_tokens, f"{arch.tiny.arch}: tokens differ (max logit diff {diff:.2e})"
    assert diff < ATOL, f"{arch.tiny.arch}: max logit diff {diff:.2e}"


@pytest.mark.parametrize("name", ARCHS)
def test_single_prompt(archs: Archs, name: str) -> None:
    """One prompt of ~5 windows, prefilled at once, then 32 decode steps."""
    arch = archs[name]
    drv = Driver(arch.spec, arch.model, page_size=4)
    seq = drv.add(prompt_of(5 * arch.window + 3, seed=1), MAX_NEW)
    drv.run([seq])
    check_against_hf(arch, seq)


@pytest.mark.parametrize("name,page_size", [(n, (1, 4, 16)[i % 3]) for i, n in enumerate(ARCHS)])
def test_batch_of_different_lengths(archs: Archs, name: str, page_size: int) -> None:
    """Prompts of 3 tokens, ~2 windows and 8 windows, prefilled and decoded in one batch."""
    arch = archs[name]
    drv = Driver(arch.spec, arch.model, page_size=page_size)
    lengths = (3, 2 * arch.window + 1, 8 * arch.window)
    seqs = [drv.add(prompt_of(n, seed=10 + i), MAX_NEW) for i, n in enumerate(lengths)]
    drv.run(seqs)
    for s in seqs:
        check_against_hf(arch, s)


@pytest.mark.parametrize("name", ARCHS)
def test_chunked_prefill_mixed_with_decode(archs: Archs, name: str) -> None:
    """Chunks smaller than the window; the short request decodes while the long one chunks."""
    arch = archs[name]
    chunk = arch.window // 2 + 1
    drv = Driver(arch.spec, arch.model, page_size=4, chunk=chunk)
    seqs = [drv.add(prompt_of(n, seed=20 + n), MAX_NEW) for n in (chunk - 2, 6 * arch.window + 1)]
    drv.run(seqs)
    for s in seqs:
        check_against_hf(arch, s)


def _reuse_case(arch: Arch, page_size: int) -> tuple[Seq, Seq]:
    """A frees its out-of-window SWA pages each step; B, admitted later into a tight SWA pool,
    gets those pages and overwrites them while A keeps decoding."""
    w = arch.window
    a_prompt = prompt_of(5 * w + 3, seed=30)
    swa_size = max(_ceil(len(a_prompt), page_size) + page_size, _ceil(w + page_size + 1, page_size))
    drv = Driver(arch.spec, arch.model, page_size=page_size, swa_size=swa_size, free_swa=True)
    a = drv.add(a_prompt, MAX_NEW)
    b = drv.add(prompt_of(3 * w + 5, seed=31), MAX_NEW)
    for _ in range(3):  # A's prefill and two decode steps, alone
        drv.step([a])
    drv.run([a, b])
    assert a.freed_swa & b.swa_written, "B never reused A's freed SWA slots: the test is vacuous"
    drv.allocator.check_integrity()
    return a, b


REUSE_CASES = [(n, 4) for n in ARCHS if n != "gemma2"] + [
    ("gemma2", 16),
    ("mimo_v2_flash", 1),
    ("mimo_v2_flash", 16),
    ("gpt_oss", 1),
]


@pytest.mark.parametrize("name,page_size", REUSE_CASES)
def test_decode_after_swa_freed_and_reused(archs: Archs, name: str, page_size: int) -> None:
    """Decode keeps matching after out-of-window SWA slots were freed and overwritten."""
    arch = archs[name]
    if not arch.spec.has_swa:
        pytest.skip("no SWA layers")
    a, b = _reuse_case(arch, page_size)
    check_against_hf(arch, a)
    check_against_hf(arch, b)


def test_single_pool_when_hybrid_disabled(archs: Archs) -> None:
    """hybrid=False: SWA layers live in the full pool and keep all their KV."""
    arch = archs["mimo_v2_flash"]
    drv = Driver(arch.spec, arch.model, page_size=4, hybrid=False, chunk=7)
    seq = drv.add(prompt_of(4 * arch.window, seed=40), MAX_NEW)
    drv.run([seq])
    check_against_hf(arch, seq)
