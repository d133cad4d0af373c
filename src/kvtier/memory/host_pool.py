"""The host tier's page pool: one flat host buffer leased from the ``PinnedBudget``.

Owns ``HostPool``: ``num_pages`` pages of one ``KVLayout`` in a single uint8 tensor (pinned when
CUDA is present), a ``PageAllocator`` over its page ids, and the byte arithmetic of the two host
layouts (see docs/architecture.md, "Host pool"):

- ``page_first``: ``[num_pages, page_bytes]``; one page is contiguous and in canonical order, so a
  store reads or writes ``pool.page(h)`` directly.
- ``layer_first``: ``[num_layers, num_pages, layer_bytes]``; one layer of every page is
  contiguous (per-layer load-back); stores go through ``copy_page_out`` / ``copy_page_in``.

The bytes are reserved from the budget before the buffer is allocated and returned by
``close()``. Bookkeeping (allocate/free ids) runs on the engine thread; IO workers and the
transfer layer read and write page bytes of ids they were handed. Nothing here blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import ConfigError, LayoutMismatch, StoreClosed
from kvtier.layout import KVLayout
from kvtier.memory.allocator import PageAllocator
from kvtier.memory.host_bytes import HostBytes, allocate_host_bytes
from kvtier.memory.pinned import PinnedBudget

if TYPE_CHECKING:
    import torch

HOST_LAYOUTS: tuple[str, ...] = ("page_first", "layer_first")


class HostPool:
    """Pages of KV in host memory; see the module docstring for the byte layouts."""

    def __init__(self, layout: KVLayout, num_pages: int, budget: PinnedBudget,
                 host_layout: str = "page_first", pin: bool | None = None,
                 owner: str = "host_pool") -> None:
        if host_layout not in HOST_LAYOUTS:
            raise ConfigError("host.layout", host_layout, ", ".join(HOST_LAYOUTS))
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ConfigError("host pool pages", num_pages, "an integer >= 0")
        self.layout = layout
        self.num_pages = num_pages
        self.host_layout = host_layout
        self.page_bytes = layout.page_bytes
        self._host: HostBytes | None = allocate_host_bytes(
            budget, owner, num_pages * layout.page_bytes, pin)
        self.allocator = PageAllocator(num_pages, name=owner)

    @classmethod
    def from_bytes(cls, layout: KVLayout, pool_bytes: int, budget: PinnedBudget,
                   host_layout: str = "page_first", pin: bool | None = None) -> HostPool:
        """A pool of as many whole pages as fit in ``pool_bytes`` (``host.pool_bytes``)."""
        return cls(layout, pool_bytes // layout.page_bytes, budget, host_layout, pin)

    # ---- the buffer --------------------------------------------------------------------------
    @property
    def buffer(self) -> torch.Tensor:
        """The flat uint8 tensor holding every page (``num_pages * page_bytes`` bytes)."""
        tensor = self._live().tensor
        assert tensor is not None, "a live pool's bytes are open"
        return tensor

    @property
    def pinned(self) -> bool:
        return self._live().pinned

    @property
    def pin_method(self) -> str:
        return self._live().method

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def closed(self) -> bool:
        return self._host is None

    def _live(self) -> HostBytes:
        if self._host is None:
            raise StoreClosed("the host pool is closed")
        return self._host

    def shaped(self) -> torch.Tensor:
        """The buffer viewed in its layout's shape (see the module docstring)."""
        buf = self.buffer
        if self.host_layout == "page_first":
            return buf.view(self.num_pages, self.page_bytes)
        return buf.view(self.layout.num_layers, self.num_pages, self.layout.layer_bytes)

    # ---- addressing --------------------------------------------------------------------------
    def part_offset(self, page: int, layer: int, part: int) -> int:
        """Byte offset in ``buffer`` of one layer's K (part 0) or V (part 1) of ``page``."""
        self._check_page(page)
        lay = self.layout
        if not 0 <= layer < lay.num_layers or not 0 <= part < lay.parts:
            raise IndexError(f"layer {layer}, part {part} outside the layout {lay.fingerprint()}")
        if self.host_layout == "page_first":
            return page * self.page_bytes + (layer * lay.parts + part) * lay.part_bytes
        return (layer * self.num_pages + page) * lay.layer_bytes + part * lay.part_bytes

    def part(self, page: int, layer: int, part: int) -> torch.Tensor:
        """A uint8 view of one part (``part_bytes``) of ``page``; contiguous in both layouts."""
        start = self.part_offset(page, layer, part)
        return self.buffer[start:start + self.layout.part_bytes]

    def page(self, page: int) -> torch.Tensor:
        """A uint8 view of ``page`` in canonical order (``page_first`` pools only)."""
        if self.host_layout != "page_first":
            raise LayoutMismatch(
                "a layer_first host pool has no contiguous page; use copy_page_out/copy_page_in")
        self._check_page(page)
        start = page * self.page_bytes
        return self.buffer[start:start + self.page_bytes]

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"host page {page} outside [0, {self.num_pages})")

    # ---- canonical copies --------------------------------------------------------------------
    def copy_page_out(self, page: int, dst: torch.Tensor) -> None:
        """Copy ``page``'s canonical bytes into ``dst`` (a uint8 tensor of ``page_bytes``)."""
        self._check_dst(dst)
        if self.host_layout == "page_first":
            dst.copy_(self.page(page))
            return
        self._check_page(page)
        lay = self.layout
        dst.view(lay.num_layers, lay.layer_bytes).copy_(self.shaped()[:, page])

    def copy_page_in(self, page: int, src: torch.Tensor) -> None:
        """Write canonical bytes ``src`` (a uint8 tensor of ``page_bytes``) into ``page``."""
        self._check_dst(src)
        if self.host_layout == "page_first":
            self.page(page).copy_(src)
            return
        self._check_page(page)
        lay = self.layout
        self.shaped()[:, page].copy_(src.view(lay.num_layers, lay.layer_bytes))

    def _check_dst(self, tensor: torch.Tensor) -> None:
        import torch

        if (tensor.dtype != torch.uint8 or tensor.numel() != self.page_bytes
                or not tensor.is_contiguous()):
            raise LayoutMismatch(
                f"a canonical page is {self.page_bytes} contiguous uint8 bytes; got "
                f"{tensor.numel()} elements of {tensor.dtype}")

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin and free the buffer and return its bytes to the budget; idempotent. Call it
        after every copy into or out of the pool has completed (the transfer layer drained)."""
        if self._host is not None:
            host, self._host = self._host, None
            host.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, object]:
        alloc = self.allocator.stats()
        return {"num_pages": self.num_pages, "page_bytes": self.page_bytes, "bytes": self.nbytes,
                "host_layout": self.host_layout, "closed": self.closed,
                "pin_method": None if self._host is None else self._host.method,
                "free": alloc["free"], "used": alloc["used"],
                "allocated_total": alloc["allocated_total"], "refused_total": alloc["refused_total"]}
