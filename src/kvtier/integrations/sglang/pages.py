"""How pages of an SGLang host pool map to the bytes kvtier stores.

Owns ``PoolPages`` and ``describe_pool()``. For SGLang's MHA and MLA host pools (the classes in
``sglang.srt.mem_cache.pool_host``, read duck-typed: ``kv_buffer``, ``layout``, ``page_size``,
``layer_num``, heads and dims) in the ``layer_first``, ``page_first``, ``page_first_direct`` and
(MHA) ``page_head`` layouts, a page is stored in kvtier's canonical order
(``[layers, K|V, page_size, heads, head_dim]``), whatever the pool's memory layout:
``canonical_view(start)`` is a strided view of that page inside the pool, and
``flat_canonical_view(page)`` the same for a flat page from ``get_data_page``. Where the view is
one contiguous run of pool memory (MLA ``page_first_direct``), stores read and write the pool
directly; otherwise one copy reorders each page through a staging buffer.

Any other pool (other classes, layouts, dtypes, DCP-split MLA) is stored "opaque": the pool's own
flat page bytes, keyed under a format tag naming the class and layout, moved with the pool's
``get_data_page``/``set_from_flat_data_page``. Torch only; called from SGLang's prefetch and
backup threads (read-only after construction).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvtier.layout import DTYPE_BYTES, KVLayout

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolPages:
    """Page geometry of one registered host pool."""

    pool: Any
    kind: str                     # "mha", "mla" or "opaque"
    page_size: int
    page_bytes: int
    page_format: str
    dtype: torch.dtype
    layout: KVLayout | None       # the rank's share in canonical order; None when opaque
    #: The pool's memory as [pages, page_bytes] rows when every canonical page is one row.
    direct_rows: np.ndarray | None = None

    @property
    def direct(self) -> bool:
        return self.direct_rows is not None

    @property
    def local_heads(self) -> int | None:
        return self.layout.num_kv_heads if self.kind == "mha" and self.layout else None

    @property
    def layer_range(self) -> tuple[int, int]:
        start = getattr(self.pool, "start_layer", 0)
        end = getattr(self.pool, "end_layer", None)
        if isinstance(start, int) and isinstance(end, int) and end > start:
            return start, end
        return 0, int(getattr(self.pool, "layer_num", 0))

    # ---- views -------------------------------------------------------------------------
    def canonical_view(self, start: int) -> torch.Tensor:
        """The page whose first token slot is ``start``, as a [L, parts, ps, H, D] view of the pool."""
        return _page_view(self.kind, self.pool.layout, self.pool.kv_buffer, start, self.page_size)

    def flat_canonical_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page (``get_data_page(i, flat=True)`` or the dummy page) in canonical order."""
        shaped = flat.view(self.dtype).reshape(self._one_page_shape())
        return _page_view(self.kind, self.pool.layout, shaped, 0, self.page_size)

    def canonical_bytes(self, view: torch.Tensor) -> np.ndarray:
        """A canonical page view as a numpy byte array of the same memory (last axis in bytes)."""
        return view.view(torch.uint8).numpy()

    def staged(self, row: np.ndarray) -> np.ndarray:
        """A flat staging row of ``page_bytes`` shaped like ``canonical_bytes`` of a page."""
        assert self.layout is not None
        *outer, dim = self.layout.page_shape()
        return row.reshape(*outer, dim * self.layout.itemsize)

    def _one_page_shape(self) -> tuple[int, ...]:
        pool, ps, layout = self.pool, self.page_size, self.pool.layout
        if self.kind == "mla":
            L, D = pool.layer_num, pool.kv_cache_dim
            return {"layer_first": (L, ps, 1, D), "page_first": (ps, L, 1, D),
                    "page_first_direct": (1, L, ps, 1, D)}[layout]
        L, H, D = pool.layer_num, pool.head_num, pool.head_dim
        return {"layer_first": (2, L, ps, H, D), "page_first": (2, ps, L, H, D),
                "page_first_direct": (2, 1, L, ps, H, D), "page_head": (2, 1, H, ps, L, D)}[layout]


def _page_view(kind: str, layout: str, kv: torch.Tensor, start: int, ps: int) -> torch.Tensor:
    if kind == "mla":
        if layout == "layer_first":                       # [L, size, 1, D]
            return kv[:, start:start + ps].unsqueeze(1)
        if layout == "page_first":                        # [size, L, 1, D]
            return kv[start:start + ps].permute(1, 0, 2, 3).unsqueeze(1)
        return kv[start // ps].unsqueeze(1)               # [pages, L, ps, 1, D]
    if layout == "layer_first":                           # [2, L, size, H, D]
        return kv[:, :, start:start + ps].permute(1, 0, 2, 3, 4)
    if layout == "page_first":                            # [2, size, L, H, D]
        return kv[:, start:start + ps].permute(2, 0, 1, 3, 4)
    if layout == "page_first_direct":                     # [2, pages, L, ps, H, D]
        return kv[:, start // ps].permute(1, 0, 2, 3, 4)
    return kv[:, start // ps].permute(3, 0, 2, 1, 4)      # page_head: [2, pages, H, ps, L, D]


def describe_pool(pool: Any) -> PoolPages:
    """Geometry of an SGLang host pool: canonical where kvtier knows its layout, else opaque."""
    known = _canonical_layout(pool)
    if known is None:
        return _opaque(pool)
    kind, layout = known
    pages = PoolPages(pool=pool, kind=kind, page_size=pool.page_size, page_bytes=layout.page_bytes,
                      page_format=layout.fingerprint(), dtype=pool.dtype, layout=layout)
    return replace(pages, direct_rows=_direct_rows(pages))


def _direct_rows(pages: PoolPages) -> np.ndarray | None:
    """The pool as [pages, page_bytes] rows if page ``p`` is exactly row ``p`` of its memory."""
    kv, ps = pages.pool.kv_buffer, pages.page_size
    count = kv.numel() * kv.element_size() // pages.page_bytes
    if count < 2 or count * pages.page_bytes != kv.numel() * kv.element_size():
        return None
    first, second = pages.canonical_view(0), pages.canonical_view(ps)
    base = kv.data_ptr()
    if not (first.is_contiguous() and second.is_contiguous() and first.data_ptr() == base
            and second.data_ptr() == base + pages.page_bytes):
        return None
    return kv.view(-1).view(torch.uint8).numpy().reshape(count, pages.page_bytes)


def _canonical_layout(pool: Any) -> tuple[str, KVLayout] | None:
    kv = getattr(pool, "kv_buffer", None)
    name = dtype_name(getattr(pool, "dtype", torch.uint8))
    if not isinstance(kv, torch.Tensor) or kv.device.type != "cpu" or name not in DTYPE_BYTES:
        return None
    if kv.dtype != pool.dtype or not kv.is_contiguous() or getattr(pool, "dcp_size", 1) != 1:
        return None
    layout, ps = getattr(pool, "layout", None), getattr(pool, "page_size", 0)
    L = getattr(pool, "layer_num", 0)
    if hasattr(pool, "kv_cache_dim") and layout in MLA_LAYOUTS:
        D, size = pool.kv_cache_dim, pool.size
        expected = {"layer_first": (L, size, 1, D), "page_first": (size, L, 1, D),
                    "page_first_direct": (size // ps, L, ps, 1, D)}[layout]
        kind, heads = "mla", 1
    elif hasattr(pool, "head_num") and layout in MHA_LAYOUTS:
        H, D, size = pool.head_num, pool.head_dim, pool.size
        if getattr(pool, "v_head_dim", D) != D:
            return None
        expected = {"layer_first": (2, L, size, H, D), "page_first": (2, size, L, H, D),
                    "page_first_direct": (2, size // ps, L, ps, H, D),
                    "page_head": (2, size // ps, H, ps, L, D)}[layout]
        kind, heads = "mha", H
    else:
        return None
    if tuple(kv.shape) != expected:
        return None
    return kind, KVLayout(num_layers=L, num_kv_heads=heads, head_dim=D, dtype=name,
                          page_size=ps, mla=kind == "mla")


def _opaque(pool: Any) -> PoolPages:
    dummy = pool.get_dummy_flat_data_page()
    nbytes = dummy.numel() * dummy.element_size()
    tag = (f"opaque:{type(pool).__name__}:{getattr(pool, 'layout', '?')}:"
           f"{dtype_name(dummy.dtype)}:{nbytes}")
    return PoolPages(pool=pool, kind="opaque", page_size=pool.page_size, page_bytes=nbytes,
                     page_format=tag, dtype=dummy.dtype, layout=None)
