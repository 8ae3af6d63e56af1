"""`HybridKVPool`: the device KV buffers, one set per layer kind.

    full pool  rows 0 .. full_size + P - 1   K [rows, full.num_kv_heads, full.head_dim]
                                             V [rows, full.num_kv_heads, full.v_head_dim]
    SWA pool   rows 0 .. swa_size + P - 1    the same with the SWA shape
    row 0 .. P - 1 (page 0) is the dummy target of padded tokens in both pools.

Layer id -> (kind, index among that kind) comes from `ModelSpec.layer_index`. With
``hybrid=False`` every layer lives in the full pool (an SWA layer keeps its own shape and its
KV is never freed early); in an all-SWA model the full pool holds no buffers at all (its slots
are still the index space of request tables). The pool never translates: SWA layers write at
``swa_loc`` that the caller translated once per forward.
"""

from __future__ import annotations

import torch

from worker.kv.allocator import check_page_size, check_pool_size
from worker.models.spec import KindShape, LayerKind, ModelSpec


def check_swa_pool_fits(swa_size: int, window: int, page_size: int) -> None:
    """Fail fast when the SWA pool cannot admit even one request (docs/design.md §6.1).

    Admission charges at least ``window + page_size`` SWA tokens per prefill and needs something
    left over, so the pool must be strictly larger than that.
    """
    if swa_size <= window + page_size:
        raise ValueError(
            f"SWA pool of {swa_size} tokens cannot hold one request: it must exceed window "
            f"({window}) + page_size ({page_size}) = {window + page_size} tokens; raise the KV "
            "budget or swa_full_tokens_ratio, or lower page_size"
        )


def _kind_buffers(
    shape: KindShape, num_layers: int, rows: int, dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    def make(dim: int) -> list[torch.Tensor]:
        return [
            torch.zeros(rows, shape.num_kv_heads, dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    return make(shape.head_dim), make(shape.v_head_dim)


class HybridKVPool:
    """Per-kind KV buffers and the write path. Buffers are tensors on `device`, dtype `dtype`."""

    def __init__(
        self,
        spec: ModelSpec,
        full_size: int,
        swa_size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        hybrid: bool = True,
    ) -> None:
        check_page_size(page_size)
        check_pool_size("full_size", full_size, page_size)
        self.spec = spec
        self.hybrid = hybrid and spec.has_swa  # no SWA layer: nothing to split
        if self.hybrid:
            check_pool_size("swa_size", swa_size, page_size)
            assert spec.window is not None  # ModelSpec guarantees it when SWA layers exist
            check_swa_pool_fits(swa_size, spec.window, page_size)
        self.full_size = full_size
        self.swa_size = swa_size if self.hybrid else full_size
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._build()

    def _build(self) -> None:
        P, dev = self.page_size, self.device
        # (kind, index) -> the pool it lives in; hybrid=False sends SWA layers to the full pool.
        counts = {kind: sum(1 for k, _ in self.spec.layer_index if k is kind) for kind in LayerKind}
        full_k, full_v = _kind_buffers(
            self.spec.full, counts[LayerKind.FULL], self.full_size + P, self.dtype, dev
        )
        swa_rows = (self.swa_size if self.hybrid else self.full_size) + P
        swa_k, swa_v = _kind_buffers(
            self.spec.swa, counts[LayerKind.SWA], swa_rows, self.dtype, dev
        )
        self._k = {LayerKind.FULL: full_k, LayerKind.SWA: swa_k}
        self._v = {LayerKind.FULL: full_v, LayerKind.SWA: swa_v}

    # ---- layout -----------------------------------------------------------------------------
    def _locate(self, layer_id: int) -> tuple[LayerKind, int]:
        if not 0 <= layer_id < self.spec.num_layers:
            raise IndexError(f"layer {layer_id} outside 0..{self.spec.num_layers - 1}")
        return self.spec.layer_index[layer_id]

    def uses_swa_pool(self, layer_id: int) -> bool:
        """SWA layer of a hybrid pool: indexed by SWA slots (translated full slots)."""
        return self.hybrid and self._locate(layer_id)[0] is LayerKind.SWA

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the layer, rows indexed by the slots of the pool it lives in."""
        kind, i = self._locate(layer_id)
        return self._k[kind][i], self._v[kind][i]

    def pool_buffers(self, pool: LayerKind) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and the V buffer of every layer whose KV lives in the full (FULL) or SWA (SWA)
        pool, in layer order: what the host tier copies (`worker/kv/transfer.py`)."""
        assert self.hybrid, "the host tier moves the KV of separate full and SWA pools"
        return self._k[pool], self._v[pool]

    def layers_in_pool(self, pool: LayerKind) -> int:
        """How many layers keep their KV in the full (FULL) or SWA (SWA) pool."""
        if not self.hybrid:
            return self.spec.num_layers if pool is LayerKind.FULL else 0
        return len(self._k[pool])

    def nbytes(self) -> int:
        """Device bytes held by all K and V buffers."""
        bufs = [b for kind in LayerKind for b in self._k[kind] + self._v[kind]]
        return sum(b.numel() * b.element_size() for b in bufs)

    # ---- write path -------------------------------------------------------------------------
    def set_kv(
        self,
        layer_id: int,
        k: torch.Tensor,
        v: torch.Tensor,
        loc: torch.Tensor,
        swa_loc: torch.Tensor | None = None,
    ) -> None:
        """Write K/V rows of `len(loc)` tokens: at `loc`, or at `swa_loc` for SWA-pool layers.

        `swa_loc` longer than `loc` (padded batch) is truncated; an SWA-pool layer without it
        raises ValueError (the pool never translates on the write path).
        """
        kind, i = self._locate(layer_id)
        where = loc
        if self.hybrid and kind is LayerKind.SWA:
            if swa_loc is None:
                raise ValueError(
                    f"layer {layer_id} is an SWA layer: set_kv needs swa_loc (translate "
                    "out_cache_loc once per forward with HybridAllocator.translate)"
                )
            n = loc.numel()
            where = swa_loc if swa_loc.numel() == n else swa_loc[:n]
        k_buf, v_buf = self._k[kind][i], self._v[kind][i]
        # NOTE: index_copy_ rather than `buf[where] = ...` (index_put_): the same write with less
        # dispatch, ~2 us less per call; two calls per layer per step.
        k_buf.index_copy_(0, where, _rows_as(k, k_buf))
        v_buf.index_copy_(0, where, _rows_as(v, v_buf))


def _rows_as(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """`x` as rows of `buf` (``[n, *buf.shape[1:]]``, its dtype)."""
    x = x.reshape(-1, *buf.shape[1:])  # a view when it can be
    return x if x.dtype == buf.dtype else x.to(buf.dtype)
