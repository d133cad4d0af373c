"""The copy engine: moves pages between the device pool and the host pool, off the compute stream.

Owns ``CopyEngine`` and ``Ticket``. The API the controller uses::

    engine = CopyEngine(device_pool, host_pool)
    ticket = engine.load(host_ids, device_ids, layers=None)   # host -> device
    ticket = engine.store(device_ids, host_ids)               # device -> host
    ticket.is_done(); ticket.wait(timeout_s) -> bool          # never raises on a timeout

On CUDA every submit checks the batch (``plan.make_plan``: ids in range, no destination twice,
matching layouts), makes a side stream wait for work already queued on the caller's current
stream (so a store copies finished KV, and a load never overwrites pages still being read),
launches one Triton kernel there and records an event. Loads and stores use two side streams so
that both can run at once. Nothing on the submitting thread ever waits for the device: ``wait``
polls the event with a short sleep up to its timeout, and a consumer that needs the pages on a
stream calls ``ticket.stream_wait()`` (a device-side dependency, no host wait).
``load_layerwise`` launches one copy per layer with an event after each, so layer ``l`` of a
forward pass can start as soon as its own KV has arrived (``ticket.stream_wait(layer=l)``).
On the kernel path those kernels run on a small grid (``layerwise_programs``, ``host.load_programs``, default
``LAYERWISE_LOAD_PROGRAMS``; 0: one per SM): the forward they overlap needs the SMs, and the
bus does not (an 8B model's 4k-token host hit on the H200 reached its
first token in 13.6-14.1 ms with 8, 16 or 32 programs, 19.7 ms with one per SM:
benchmarks/results/ttft_breakdown_graphs_h200.txt).

``path="copy_engine"`` moves the bytes with the GPU's copy engines instead of the UVA kernels
(``staged.StagedCopier``: whole-page or page-and-layer copies through a fixed device staging
buffer per direction, ``staging_bytes`` each): no SMs used, and a load and a store at once reach
the bus's duplex rate. ``path="auto"`` (the default) sends every load (``load`` and
``load_layerwise``) through the copy engines and stores through the kernels: a UVA kernel
reads host memory at a rate that depends on the host (on two H100 hosts of one kind, 50.7 and
33 GB/s for the same 4.3 GB load, where the copy engines reached 55 on both:
benchmarks/results/vllm_gpu_h100_*.txt; an 8B model's 32k-token host hit, loaded layer by
layer beside its forward, reached its first token in 94 ms through the copy engines and in
145 ms through the kernels on one H100: benchmarks/results/engine_paths_h100.txt), while its
writes to host memory kept their rate (16 programs store at the bus rate beside the forward).
The copy-engine paths need the ``page_first`` host layout and a driver with
``cuMemcpyBatchAsync``; otherwise the kernels serve and ``stats()["path_fallback"]`` says
why.

Without CUDA (or with ``use_kernels=False``) the torch reference runs synchronously and tickets
are done at once. Submits come from one thread (the engine thread); tickets may be polled from
any thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import LayoutMismatch
from kvtier.transfer.plan import (
    CopyPlan,
    PageIds,
    PoolGeometry,
    device_geometry,
    host_geometry,
    layer_range,
    make_plan,
)
from kvtier.transfer.reference import reference_copy

if TYPE_CHECKING:
    from kvtier.memory.device_pool import DevicePool
    from kvtier.memory.host_pool import HostPool
    from kvtier.transfer.ce_batch import BatchCopy
    from kvtier.transfer.kernels import KernelConfig
    from kvtier.transfer.staged import StagedCopier

#: The ways pages cross the bus (``path``; see the module docstring).
PATHS = ("auto", "kernel", "copy_engine")
#: Grid cap of layer-by-layer loads (when no ``load_config`` or ``layerwise_programs`` is given).
LAYERWISE_LOAD_PROGRAMS = 16
_FIRST_POLL_S = 20e-6
_LONGEST_POLL_S = 1e-3

Layers = int | Sequence[int] | range | None


class Ticket:
    """One submitted copy. ``is_done``/``wait`` ask whether its bytes have all landed."""

    __slots__ = ("_events", "_layer0", "direction", "nbytes", "num_pages")

    def __init__(self, direction: str, num_pages: int, nbytes: int,
                 events: list[torch.cuda.Event] | None = None, layer0: int = 0) -> None:
        self.direction = direction
        self.num_pages = num_pages
        self.nbytes = nbytes
        self._events = events or []
        self._layer0 = layer0

    def is_done(self) -> bool:
        """Whether every byte has landed (never blocks)."""
        return all(_landed(event) for event in self._events[-1:])

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit); True once done, False on timeout."""
        return self._poll(self._events[-1:], timeout)

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer`` has landed (a per-layer ticket; others: the whole copy)."""
        return self._poll(self._layer_event(layer), 0.0)

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return self._poll(self._layer_event(layer), timeout)

    def stream_wait(self, stream: torch.cuda.Stream | None = None,
                    layer: int | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for this copy, or for one layer of a
        per-layer ticket, on the device; the calling thread does not wait."""
        events = self._events[-1:] if layer is None else self._layer_event(layer)
        if not events:
            return
        target = stream if stream is not None else torch.cuda.current_stream()
        target.wait_event(events[0])

    def _layer_event(self, layer: int) -> list[torch.cuda.Event]:
        if len(self._events) <= 1:
            return self._events
        index = layer - self._layer0
        if not 0 <= index < len(self._events):
            raise IndexError(f"layer {layer} is not part of this copy")
        return [self._events[index]]

    @staticmethod
    def _poll(events: list[torch.cuda.Event], timeout: float | None) -> bool:
        if not events or _landed(events[0]):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_POLL_S
        while not _landed(events[0]):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                pause = min(pause, left)
            time.sleep(pause)
            pause = min(pause * 2, _LONGEST_POLL_S)
        return True


class CopyEngine:
    """Copies between one ``DevicePool`` and one ``HostPool`` (see the module docstring).

    ``load_config`` / ``store_config`` (``kernels.KernelConfig``) set each direction's launch
    shape; a grid cap below the chip lets a load and a store share it.
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *,
                 use_kernels: bool | None = None,
                 load_config: KernelConfig | None = None,
                 store_config: KernelConfig | None = None, path: str = "auto",
                 staging_bytes: int = 64 << 20, batch_copy: BatchCopy | None = None,
                 layerwise_programs: int = LAYERWISE_LOAD_PROGRAMS) -> None:
        if device_pool.layout != host_pool.layout:
            raise LayoutMismatch(f"device pool {device_pool.layout.fingerprint()} vs host pool "
                                 f"{host_pool.layout.fingerprint()}")
        self._device_pool = device_pool
        self._host_pool = host_pool
        self._device_geo: PoolGeometry = device_geometry(device_pool.layout, device_pool.num_pages)
        self._host_geo: PoolGeometry = host_geometry(host_pool.layout, host_pool.num_pages,
                                                     host_pool.host_layout)
        self._device = device_pool.kv.device
        on_cuda = self._device.type == "cuda"
        self._use_kernels = on_cuda if use_kernels is None else use_kernels
        self._configs = {"load": load_config, "store": store_config}
        self._layerwise_config: KernelConfig | None = None
        if on_cuda:
            from kvtier.transfer.kernels import KernelConfig

            self._layerwise_config = KernelConfig(max_programs=layerwise_programs or None)
        self._streams = ({direction: _stream(self._device) for direction in ("load", "store")}
                         if on_cuda else {})
        self._counts = {"load": [0, 0, 0], "store": [0, 0, 0]}  # batches, pages, bytes
        self._staged: dict[str, StagedCopier] = {}
        self.path_fallback = ""
        if path not in PATHS:
            raise ValueError(f"copy path must be one of {', '.join(PATHS)}, got {path!r}")
        if path == "copy_engine" or (path == "auto" and (on_cuda or batch_copy is not None)):
            directions = ("load", "store") if path == "copy_engine" else ("load",)
            self._staged, self.path_fallback = self._stage(staging_bytes, batch_copy, directions)
        self._path = path if self._staged else "kernel"

    def _stage(self, staging_bytes: int, batch_copy: BatchCopy | None,
               directions: tuple[str, ...]) -> tuple[dict[str, StagedCopier], str]:
        """One ``StagedCopier`` per direction of ``directions``, or ({}, why not)."""
        from kvtier.transfer.ce_batch import load_batch_copy
        from kvtier.transfer.staged import StagedCopier

        if self._host_pool.host_layout != "page_first":
            return {}, "the copy-engine path needs the page_first host layout"
        batch = batch_copy or (load_batch_copy() if self._device.type == "cuda" else None)
        if batch is None:
            return {}, "the CUDA driver has no cuMemcpyBatchAsync (12.8 or newer)"
        self.batch_copy = batch
        return {direction: StagedCopier(
            self._device_pool.kv, self._host_pool.buffer, self._host_geo,
            torch.empty(staging_bytes, dtype=torch.uint8, device=self._device), batch,
            self._configs[direction]) for direction in directions}, ""

    @property
    def device_pool(self) -> DevicePool:
        """The ``DevicePool`` this engine copies to and from (read-only)."""
        return self._device_pool

    @property
    def host_pool(self) -> HostPool:
        """The ``HostPool`` this engine copies to and from (read-only)."""
        return self._host_pool

    @property
    def path(self) -> str:
        """``kernel``, ``copy_engine`` or ``auto`` (as asked, unless it fell back to kernels)."""
        return self._path

    def _staged_for(self, plan: CopyPlan) -> StagedCopier | None:
        """The copy-engine copier that moves ``plan``, or None for the kernels (``auto`` stages
        loads only, so a store finds none)."""
        return self._staged.get(plan.direction)

    @property
    def staging_bytes(self) -> int:
        """Device bytes held for copy-engine staging (0 on the kernel path)."""
        return sum(int(c._staging.numel()) for c in self._staged.values())

    @property
    def uses_kernels(self) -> bool:
        return self._use_kernels

    @property
    def asynchronous(self) -> bool:
        """Whether copies run on side streams and may still be in flight after a submit."""
        return bool(self._streams)

    def load(self, host_ids: PageIds, device_ids: PageIds, layers: Layers = None) -> Ticket:
        """Copy pages ``host_ids[i]`` of the host pool to ``device_ids[i]`` of the device pool
        (all layers, or a contiguous ``layers`` range), in one launch."""
        plan = make_plan("load", self._host_geo, self._device_geo, host_ids, device_ids, layers)
        return self._submit(plan, [(plan.layer_start, plan.layer_count)])

    def load_layerwise(self, host_ids: PageIds, device_ids: PageIds, layers: Layers = None) -> Ticket:
        """Like ``load``, one launch and one event per layer, so the model can start on layer
        ``l`` once ``ticket.stream_wait(layer=l)`` is satisfied."""
        plan = make_plan("load", self._host_geo, self._device_geo, host_ids, device_ids, layers)
        start, count = layer_range(layers, self._device_geo.num_layers)
        return self._submit(plan, [(layer, 1) for layer in range(start, start + count)],
                            self._configs["load"] or self._layerwise_config)

    def store(self, device_ids: PageIds, host_ids: PageIds, layers: Layers = None) -> Ticket:
        """Copy pages ``device_ids[i]`` of the device pool to ``host_ids[i]`` of the host pool."""
        plan = make_plan("store", self._device_geo, self._host_geo, device_ids, host_ids, layers)
        return self._submit(plan, [(plan.layer_start, plan.layer_count)])

    def _submit(self, plan: CopyPlan, spans: list[tuple[int, int]],
                config: KernelConfig | None = None) -> Ticket:
        counts = self._counts[plan.direction]
        counts[0] += 1
        counts[1] += plan.num_pages
        counts[2] += plan.nbytes
        if plan.num_pages == 0:
            return Ticket(plan.direction, 0, 0)
        staged = self._staged_for(plan)
        if not self._streams:
            for start, count in spans:
                self._run_now(_with_layers(plan, start, count), staged)
            return Ticket(plan.direction, plan.num_pages, plan.nbytes)
        events = self._launch_on_side_stream(plan, spans, config or self._configs[plan.direction],
                                             staged)
        return Ticket(plan.direction, plan.num_pages, plan.nbytes, events, spans[0][0])

    def _run_now(self, plan: CopyPlan, staged: StagedCopier | None) -> None:
        if staged is not None:
            staged.run(plan)
        elif self._use_kernels:
            from kvtier.transfer.kernels import launch_copy

            launch_copy(plan, self._device_pool.kv, self._host_pool.buffer,
                        self._configs[plan.direction])
        else:
            reference_copy(plan, self._device_pool.kv, self._host_pool.buffer,
                           self._host_pool.host_layout)

    def _launch_on_side_stream(self, plan: CopyPlan, spans: list[tuple[int, int]],
                               config: KernelConfig | None,
                               staged: StagedCopier | None) -> list[torch.cuda.Event]:
        from kvtier.transfer.kernels import PreparedCopy

        stream = self._streams[plan.direction]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        events = []
        with torch.cuda.stream(stream):
            kernels = self._use_kernels and staged is None
            prepared = (PreparedCopy(plan, self._device_pool.kv, self._host_pool.buffer, config)
                        if kernels else None)
            for start, count in spans:
                if staged is not None:
                    staged.run(_with_layers(plan, start, count))
                elif prepared is not None:
                    prepared.launch(start, count)
                else:
                    part = _with_layers(plan, start, count)
                    reference_copy(part, self._device_pool.kv, self._host_pool.buffer,
                                   self._host_pool.host_layout)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: untyped
                event.record(stream)
                events.append(event)
        return events

    def warm_up(self, device_id: int, host_id: int) -> None:
        """Run every kind of copy this engine launches once, between pages ``device_id`` and
        ``host_id`` (neither may hold anything: their bytes are overwritten), and wait: the
        kernels are compiled, or loaded from Triton's disk cache, now and not inside the first
        request that needs them (vLLM warns of every such compile during inference)."""
        self.store([device_id], [host_id]).wait(None)
        self.load([host_id], [device_id]).wait(None)
        self.load_layerwise([host_id], [device_id]).wait(None)

    def stats(self) -> dict[str, object]:
        """Batches, pages and bytes submitted per direction, and the path in use."""
        kind = "triton" if self._use_kernels else "torch_reference"
        out: dict[str, object] = {"path": self._path if self._staged else kind,
                               "device": str(self._device), "staging_bytes": self.staging_bytes}
        if self.path_fallback:
            out["path_fallback"] = self.path_fallback
        for direction, (batches, pages, nbytes) in self._counts.items():
            out[f"{direction}_batches"] = batches
            out[f"{direction}_pages"] = pages
            out[f"{direction}_bytes"] = nbytes
        return out


def _with_layers(plan: CopyPlan, start: int, count: int) -> CopyPlan:
    if (start, count) == (plan.layer_start, plan.layer_count):
        return plan
    return CopyPlan(plan.direction, plan.src, plan.dst, plan.src_ids, plan.dst_ids, start, count)


def _landed(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]  # torch: untyped


def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: untyped
