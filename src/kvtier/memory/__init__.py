"""kvtier.memory: host and device page memory and the discipline around it.

Owns the pinned-byte ledger (``PinnedBudget``), the fixed-slot ``PageAllocator`` shared by the
device and host pools, the host tier's ``HostPool``, the ``ReadRing`` that storage reads land in
and the ``WriteAdmission`` ledger that bounds write-through staging. Importing this package does
not import torch; buffers are allocated (and torch imported) when a pool or ring is built.
"""

from kvtier.memory.admission import WriteAdmission, staging_capacity_pages
from kvtier.memory.allocator import PageAllocator
from kvtier.memory.host_bytes import HOST_ALIGN_BYTES, HostBytes, allocate_host_bytes
from kvtier.memory.host_pool import HOST_LAYOUTS, HostPool
from kvtier.memory.pinned import PinnedBudget, PinnedLease
from kvtier.memory.ring import ReadRing, RingBuffer

__all__ = [
    "HOST_ALIGN_BYTES",
    "HOST_LAYOUTS",
    "HostBytes",
    "HostPool",
    "PageAllocator",
    "PinnedBudget",
    "PinnedLease",
    "ReadRing",
    "RingBuffer",
    "WriteAdmission",
    "allocate_host_bytes",
    "staging_capacity_pages",
]
