"""KV layout: the shape of one page of attention KV and its canonical byte order.

Owns ``KVLayout`` (layers, KV heads, head dim, dtype, page size; MLA as one latent head with
no separate V) and the arithmetic that maps a head range (a tensor-parallel rank's share) or
a layer range (a pipeline stage's share) to byte ranges of a stored page. Pure Python, no
torch; called from any thread.

Canonical page byte order (what every store holds, whatever the engine's parallel layout)::

    for layer in range(num_layers):          # layer-major
        for part in ("k", "v"):              # "k" only for MLA
            [page_size, num_kv_heads, head_dim] elements, row-major
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.errors import ConfigError

#: Bytes per element of each KV dtype kvtier stores. Stores treat every dtype as opaque bytes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A contiguous span of a page: ``offset`` bytes from the page start, ``length`` bytes."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one page of KV for every layer of a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"layout.{name}", value, "an integer >= 1")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError("layout.dtype", self.dtype, ", ".join(sorted(DTYPE_BYTES)))
        if self.mla and self.num_kv_heads != 1:
            raise ConfigError("layout.num_kv_heads", self.num_kv_heads, "1 for an MLA layout")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def parts(self) -> int:
        """Tensors per layer: 2 (K and V), or 1 for MLA's latent."""
        return 1 if self.mla else 2

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token's K (or V) for one layer: heads x head_dim elements."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def part_bytes(self) -> int:
        """Bytes of one layer's K (or V) for one page."""
        return self.page_size * self.token_row_bytes

    @property
    def layer_bytes(self) -> int:
        return self.parts * self.part_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page for all layers, in canonical order."""
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.page_bytes // self.page_size

    def part_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V) for one page: [page_size, kv_heads, head_dim]."""
        return (self.page_size, self.num_kv_heads, self.head_dim)

    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one canonical page: [layers, parts, page_size, kv_heads, head_dim]."""
        return (self.num_layers, self.parts, *self.part_shape())

    def fingerprint(self) -> str:
        """A stable text naming everything that changes the bytes of a page."""
        kind = "mla" if self.mla else "mha"
        return (
            f"{kind}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":{self.dtype}:P{self.page_size}"
        )

    # ---- slices ------------------------------------------------------------------------
    def head_range_for_rank(self, rank: int, world: int) -> tuple[int, int]:
        """The KV heads a tensor-parallel rank holds (all heads when heads < world, as with MLA
        or heavily grouped attention, where ranks replicate KV)."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        if self.num_kv_heads < world:
            return (0, self.num_kv_heads)
        if self.num_kv_heads % world:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split evenly over {world} ranks")
        share = self.num_kv_heads // world
        return (rank * share, (rank + 1) * share)

    def for_heads(self, heads: tuple[int, int]) -> KVLayout:
        """The layout of KV heads ``[h0, h1)`` alone: what a rank holding them keeps per page
        (its pools, and the canonical page of its share)."""
        h0, h1 = heads
        if not 0 <= h0 < h1 <= self.num_kv_heads:
            raise ValueError(f"head range [{h0}, {h1}) outside [0, {self.num_kv_heads})")
        return KVLayout(self.num_layers, h1 - h0, self.head_dim, self.dtype, self.page_size,
                        self.mla)

    def byte_ranges(
        self,
        heads: tuple[int, int] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> list[ByteRange]:
        """Byte ranges of a page that hold KV heads ``[h0, h1)`` of layers ``[l0, l1)``.

        Ranges are in page order and coalesced: a full head range gives one range per layer
        span, a full page gives one range.
        """
        h0, h1 = heads if heads is not None else (0, self.num_kv_heads)
        l0, l1 = layers if layers is not None else (0, self.num_layers)
        if not 0 <= h0 < h1 <= self.num_kv_heads:
            raise ValueError(f"head range [{h0}, {h1}) outside [0, {self.num_kv_heads})")
        if not 0 <= l0 < l1 <= self.num_layers:
            raise ValueError(f"layer range [{l0}, {l1}) outside [0, {self.num_layers})")
        return _coalesce(self._raw_ranges(h0, h1, l0, l1))

    def slice_bytes(self, heads: tuple[int, int] | None = None,
                    layers: tuple[int, int] | None = None) -> int:
        """Total bytes of the slice that ``byte_ranges`` describes."""
        return sum(r.length for r in self.byte_ranges(heads, layers))

    def _raw_ranges(self, h0: int, h1: int, l0: int, l1: int) -> Iterator[ByteRange]:
        head_bytes = self.head_dim * self.itemsize
        span = (h1 - h0) * head_bytes
        for layer in range(l0, l1):
            for part in range(self.parts):
                base = layer * self.layer_bytes + part * self.part_bytes
                for token in range(self.page_size):
                    yield ByteRange(base + token * self.token_row_bytes + h0 * head_bytes, span)


def _coalesce(ranges: Iterator[ByteRange]) -> list[ByteRange]:
    out: list[ByteRange] = []
    for r in ranges:
        if out and out[-1].end == r.offset:
            out[-1] = ByteRange(out[-1].offset, out[-1].length + r.length)
        else:
            out.append(r)
    return out
