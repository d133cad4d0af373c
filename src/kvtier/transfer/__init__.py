"""kvtier.transfer: the only layer that moves KV bytes between device memory and host memory.

Owns the copy engine (``CopyEngine``, ``Ticket``: side-stream copies with events, the API the
controller uses), the Triton gather/scatter kernels that read and write pinned host memory
directly (``kernels``, imported lazily: importing this package does not import Triton), the
torch reference that is both the CPU fallback and the kernels' oracle (``reference``), the
batch checks and pool geometry (``plan``) and the process-safe Triton cache manager
(``triton_cache``). See each module's docstring for the thread that runs it.
"""

from kvtier.transfer.copy_engine import CopyEngine, Ticket
from kvtier.transfer.plan import CopyPlan, PoolGeometry, device_geometry, host_geometry, make_plan

__all__ = [
    "CopyEngine",
    "CopyPlan",
    "PoolGeometry",
    "Ticket",
    "device_geometry",
    "host_geometry",
    "make_plan",
]
