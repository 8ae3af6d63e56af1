"""The host tier's memory and copies (docs/design.md §9.9): sizing, host page allocators, a
copy round trip through the host layout, and when a forward must wait for its step's copies."""

from __future__ import annotations

import pytest
import torch

from tests.worker.kv.test_mem_pool import spec
from worker.errors import ConfigError
from worker.kv import HybridKVPool
from worker.kv.host_pool import HostAllocator, HostKVPool
from worker.kv.hybrid_allocator import HybridAllocator
from worker.kv.memory_plan import HostPlan, plan_host_pools, plan_pools
from worker.kv.transfer import LocalCopier, Move, TransferQueue
from worker.models.spec import LayerKind

F, S = LayerKind.FULL, LayerKind.SWA
P = 4


def test_host_plan_splits_like_the_device_and_refuses_one_pool() -> None:
    """Host tokens per kind follow the ratio; bytes are tokens x bytes per token; one shared
    device pool (no SWA split) has no host tier."""
    s = spec()
    device = plan_pools(s, page_size=P, dtype_bytes=2, max_total_tokens=256)
    f, w = s.kind_bytes_per_token(F, 2), s.kind_bytes_per_token(S, 2)
    host = plan_host_pools(s, device, dtype_bytes=2, host_kv_bytes=100 * (f + w // 2), ratio=0.5)
    assert (host.full_tokens, host.swa_tokens) == (100, 48)
    assert (host.full_bytes, host.swa_bytes) == (100 * f, 48 * w)
    single = plan_pools(s, page_size=P, dtype_bytes=2, max_total_tokens=256, disable_hybrid_swa_memory=True)
    with pytest.raises(ConfigError, match="separate full and SWA pools"):
        plan_host_pools(s, single, dtype_bytes=2, host_kv_bytes=1 << 20, ratio=0.5)


def test_host_allocator_hands_out_whole_pages_and_detects_double_frees() -> None:
    """Slots of whole pages per kind; free + held == total; a double free raises."""
    a = HostAllocator(16, 8, P)
    full = a.alloc(F, 8)
    assert full is not None and full.tolist() == list(range(4, 12))
    assert a.alloc(S, 12) is None and a.available(S) == 8
    a.free(F, full)
    assert a.available(F) == a.size(F) == 16
    with pytest.raises(ValueError, match="double free"):
        a.free(F, full)
    a.check_integrity()


def _tier() -> tuple[HybridAllocator, HybridKVPool, LocalCopier, TransferQueue]:
    s = spec()
    alloc = HybridAllocator(32, 16, P)
    pool = HybridKVPool(s, 32, 16, P, torch.float32, "cpu")
    host = HostKVPool(s, HostPlan(16, 16, P, 0, 0), {F: 1, S: 3}, torch.float32, pin=False)
    for layer in range(s.num_layers):
        for buf in pool.kv_buffers(layer):
            buf.copy_(torch.randn_like(buf))
    return alloc, pool, LocalCopier(pool, host), TransferQueue(alloc)


def test_offload_then_load_elsewhere_restores_every_layer() -> None:
    """Two device pages to host pages out of order, then back into other device pages: every
    layer's K and V of the pool arrive unchanged (the host layout is page-major)."""
    alloc, pool, copier, queue = _tier()
    src = alloc.alloc(8)
    assert src is not None
    swa = alloc.translate(src)
    before = [b[swa].clone() for layer in (0, 2, 3) for b in pool.kv_buffers(layer)]
    host = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])
    queue.add(Move.OFFLOAD, S, swa, host)
    alloc.free(src)
    batch = queue.take()
    assert batch is not None and not batch.wait, "nothing reuses the offloaded pages yet"
    copier.issue(batch)
    dst = alloc.alloc(8)
    assert dst is not None
    dst_swa = alloc.translate(dst)
    for layer in (0, 2, 3):
        for b in pool.kv_buffers(layer):
            b[dst_swa] = 0.0
    queue.add(Move.LOAD, S, dst_swa, host)
    batch = queue.take()
    assert batch is not None and batch.wait, "a load: the forward waits"
    copier.issue(batch)
    after = [b[dst_swa] for layer in (0, 2, 3) for b in pool.kv_buffers(layer)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert queue.moved[Move.OFFLOAD, S] == queue.moved[Move.LOAD, S] == 8


def test_forward_waits_once_an_offloaded_page_is_handed_out_again() -> None:
    """Offloads alone overlap the forward; once an offloaded device page is allocated again
    (this step or a later one) the next forward waits, and only then."""
    alloc, _, _, queue = _tier()
    src = alloc.alloc(4)
    assert src is not None
    queue.add(Move.OFFLOAD, F, src, torch.arange(4, 8))
    alloc.free(src)
    first = queue.take()
    assert first is not None and not first.wait
    assert queue.take() is None
    other = alloc.alloc_full(32)  # every full page: the offloaded one again too
    assert other is not None and int(src[0]) // P in (other // P).tolist()
    queue.add(Move.OFFLOAD, F, other[:4], torch.arange(8, 12))
    second = queue.take()
    assert second is not None and second.wait, "the first step's offloaded page is reused"
