"""Support code of the vLLM copy-path tests: kvtier's connector worker half on plain tensors.

``make_runtime`` builds the ``ConnectorRuntime`` both connector halves share (a ``TieredCache``
with a host tier, the saver thread) from a model shape alone, without vLLM; ``vllm_caches``
makes one KV tensor per layer in an attention backend's layout, filled with random bits;
``Step`` is a step's metadata as the worker half reads it; ``round_trip`` saves a prompt from
one set of tensors, drops kvtier's device copy of it and loads it back into another at other
block ids, the way a later request's hit arrives.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvtier.integrations.vllm.options import parse_connector_config
from kvtier.integrations.vllm.runtime import ConnectorRuntime, ModelShape, _build_cache_here
from kvtier.integrations.vllm.saver import Saver
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.keys import KeyNamespace

#: Test layouts: vLLM's logical ``[blocks, heads, tokens, 2 * head_dim]`` with tokens outer in
#: memory (``nhd``, vLLM's default), heads outer (``hnd``), or the CPU backend's blocks (``cpu``).
#: ``tests/vllm_suite/test_layout.py`` holds the same reads against vLLM's own allocation.
BACKENDS = {"nhd": "FLASH_ATTN", "hnd": "FLASHINFER", "cpu": "CPU_ATTN"}


#: The small model shape and scattered blocks the CPU copy tests share.
LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 2, 16, 16, 12
OLD, NEW = (5, 9, 2, 0, 7), (3, 11, 1, 8, 4)
#: Marks tests of the kernels, which run on the CPU only under the Triton interpreter.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernels run on the CPU only under TRITON_INTERPRET=1")


@dataclass
class Step:
    """One step's metadata (what ``KvtierConnectorMetadata`` carries)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    whole_loads: bool = False
    held: list[str] = field(default_factory=list)


def make_runtime(layers: int, heads: int, dim: int, dtype: torch.dtype, block: int,
                 device: str, staging_pages: int, page: int | None = None,
                 direct: bool = False, host_layout: str = "page_first") -> ConnectorRuntime:
    """``page``: kvtier's page size (default: the block size). ``direct``: the direct path
    (no staging pages; a host tier of ``2 * staging_pages`` pages all the same)."""
    name = str(dtype).removeprefix("torch.")
    page = page or block
    shape = ModelShape("copy-test", tuple(f"layer.{i}" for i in range(layers)), heads, dim,
                       name, block)
    layout = shape.layout(page)
    extra: dict[str, Any] = {"direct": True} if direct else {"staging_pages": staging_pages}
    options = parse_connector_config({**extra, "page_size": page,
                                      "host_pool_bytes": 2 * staging_pages * layout.page_bytes,
                                      "background_priority": "normal"}, block)
    config = options.config
    host = dataclasses.replace(config.host, layout=host_layout)
    options = dataclasses.replace(options, config=dataclasses.replace(config, host=host))
    namespace = KeyNamespace(shape.model, "fingerprint", name, layout.fingerprint(), page)
    saver = Saver(options.save_queue_depth, options.background_priority)
    cache = saver.call(lambda: _build_cache_here(options, layout, namespace, device))
    return ConnectorRuntime(options, shape, cache, namespace, saver)


def packed_kv(kind: str, num_blocks: int, block: int, heads: int, dim: int,
              dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zeroed ``[num_blocks, heads, block, 2 * dim]`` tensor in ``kind``'s memory order."""
    if kind == "nhd":
        return torch.zeros(num_blocks, block, heads, 2 * dim, dtype=dtype,
                           device=device).permute(0, 2, 1, 3)
    return torch.zeros(num_blocks, heads, block, 2 * dim, dtype=dtype, device=device)


def vllm_caches(runtime: ConnectorRuntime, kind: str, num_blocks: int, device: str,
                seed: int | None) -> dict[str, torch.Tensor]:
    """One tensor per layer in ``kind``'s layout: random bits (``seed``) or zeros (None)."""
    s = runtime.shape
    dtype = getattr(torch, s.dtype)
    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name in s.layer_names:
        kv = packed_kv(kind, num_blocks, s.block_size, s.kv_heads, s.head_dim, dtype, device)
        if seed is not None:
            bits = torch.randint(-2**15, 2**15, kv.shape, dtype=torch.int16, generator=g)
            kv.copy_(bits.view(dtype))
        out[name] = kv
    return out


def slots(blocks: tuple[int, ...], block: int, count: int) -> torch.Tensor:
    return torch.cat([torch.arange(b * block, (b + 1) * block) for b in blocks])[:count]


def round_trip(runtime: ConnectorRuntime, save_kind: str, load_kind: str, num_blocks: int,
               device: str, tokens: list[int], old_blocks: tuple[int, ...],
               new_blocks: tuple[int, ...], load_tokens: int,
               use_kernels: bool, in_flight: Any = None,
               handles: list[Any] | None = None, busy_ms: float = 0.0, hooks: bool = True,
               copy_in_step: bool | None = None,
               ) -> tuple[WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Save ``tokens`` from random ``save_kind`` tensors at ``old_blocks``, then load the first
    ``load_tokens`` of them from kvtier's host tier into zeroed ``load_kind`` tensors at
    ``new_blocks``; returns the worker, the source and the target tensors.

    The load is staged as the scheduler half stages it (on CUDA its host -> pool copy left in
    flight, layer by layer); ``in_flight`` replaces the staged load's ticket (a stand-in copy
    that has not landed, for the CPU), and ``handles`` receives the staged load. ``busy_ms``
    (CUDA) keeps the device busy that long before the load is staged, as the previous step's
    forward does, so that the load's copy is still on the bus when the worker's copies start.
    ``hooks`` False runs both steps as a full CUDA graph replay does: no per-layer hook, the
    loads copied whole before the forward (``load_all_layers``), the saves after it.
    ``copy_in_step`` (default: on CUDA) saves inside ``wait_for_save`` as on CUDA."""
    on_cuda = device.startswith("cuda")
    in_step = on_cuda if copy_in_step is None else copy_in_step
    worker = WorkerSide(runtime, copy_in_step=in_step, use_kernels=use_kernels)
    source = vllm_caches(runtime, save_kind, num_blocks, device, seed=7)
    worker.register_kv_caches(source, BACKENDS[save_kind])
    saving = Step(saves=[SaveSpec("w", tuple(tokens), None, old_blocks)])
    for name, kv in source.items() if hooks else ():
        worker.save_kv_layer(saving, name, kv)
    worker.wait_for_save(saving)
    assert runtime.drain(60.0)
    assert runtime.counts["saved_tokens"] == len(tokens)
    if busy_ms and on_cuda:
        torch.cuda._sleep(int(busy_ms * 2e6))   # ~2e6 cycles a millisecond at the H200's clock
    with runtime.lock:
        runtime.cache.clear_tier("device")
        # Other bytes in every staging page (the save left this prompt's there), so that the
        # rows reaching vLLM's blocks can only have come from the host tier.
        runtime.cache.device_pool.kv.view(torch.uint8).fill_(0xA5)
        loaded = runtime.cache.load(runtime.cache.match(tokens), overlap=True)
        if in_flight is not None:
            loaded.ticket = in_flight
        runtime.staged["r"] = loaded
    if handles is not None:
        handles.append(loaded)
    return worker, source, _load_staged(worker, load_kind, num_blocks, device, load_tokens,
                                        new_blocks, hooks)


def _load_staged(worker: WorkerSide, load_kind: str, num_blocks: int, device: str,
                 load_tokens: int, new_blocks: tuple[int, ...], hooks: bool,
                 ) -> dict[str, torch.Tensor]:
    """Load the hit staged as ``"r"`` into zeroed ``load_kind`` tensors as one step does."""
    target = vllm_caches(worker.runtime, load_kind, num_blocks, device, seed=None)
    worker.register_kv_caches(target, BACKENDS[load_kind])
    worker.start_load_kv(Step(loads=[LoadSpec("r", 0, load_tokens, new_blocks)]))
    if not hooks:
        worker.load_all_layers()
    for name in target if hooks else ():
        worker.wait_for_layer_load(name)
    worker.wait_for_save(Step())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return target


def direct_round_trip(runtime: ConnectorRuntime, save_kind: str, load_kind: str,
                      num_blocks: int, device: str, tokens: list[int],
                      old_blocks: tuple[int, ...], new_blocks: tuple[int, ...],
                      load_tokens: int, use_kernels: bool,
                      ) -> tuple[WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``round_trip`` on the direct path (``make_runtime(direct=True)``): the save goes from
    vLLM's blocks straight into host pages in ``wait_for_save``, the hit is held on host as the
    scheduler half holds it, and the load, started in ``start_load_kv``, copies host pages
    into the target's blocks until the worker reports it received."""
    worker = WorkerSide(runtime, copy_in_step=True, use_kernels=use_kernels)
    source = vllm_caches(runtime, save_kind, num_blocks, device, seed=7)
    worker.register_kv_caches(source, BACKENDS[save_kind])
    worker.wait_for_save(Step(saves=[SaveSpec("w", tuple(tokens), None, old_blocks)]))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    assert runtime.drain(60.0)
    assert runtime.counts["saved_tokens"] == len(tokens) // runtime.page_size * runtime.page_size
    with runtime.lock:
        runtime.staged["r"] = runtime.cache.hold_host(runtime.cache.match(tokens))
    target = vllm_caches(runtime, load_kind, num_blocks, device, seed=None)
    worker.register_kv_caches(target, BACKENDS[load_kind])
    worker.start_load_kv(Step(loads=[LoadSpec("r", 0, load_tokens, new_blocks)]))
    worker.wait_for_save(Step())
    received: set[str] = set()
    for _ in range(10_000):
        received |= worker.take_received() or set()
        if "r" in received:
            break
        time.sleep(0.001)
    assert received == {"r"}
    return worker, source, target


def check_moved(save_kind: str, load_kind: str, source: dict[str, torch.Tensor],
                target: dict[str, torch.Tensor], was: torch.Tensor, now: torch.Tensor,
                heads: int, dim: int) -> None:
    """Rows at slots ``now`` of ``target`` equal ``source``'s at ``was`` bit for bit, and every
    other slot of ``target`` is still zero."""
    from kvtier.integrations.vllm.layout import block_layout

    for name in source:
        save = block_layout(BACKENDS[save_kind], source[name], heads, dim)
        load = block_layout(BACKENDS[load_kind], target[name], heads, dim)
        for got, want in zip(load.read(target[name], now), save.read(source[name], was),
                             strict=True):
            assert torch.equal(as_words(got), as_words(want)), name
        slots_in_all = load.num_blocks * load.block_size
        rest = torch.tensor(sorted(set(range(slots_in_all)) - set(now.tolist())))
        for untouched in load.read(target[name], rest):
            assert int(as_words(untouched).abs().sum()) == 0, f"{name}: a slot outside the load"


class HeldCopy:
    """A stand-in for a host -> pool copy still in flight: lands only on ``land()`` (or on a
    host ``wait``), and records the layers a stream was made to wait for."""

    def __init__(self) -> None:
        self.waited: list[int | None] = []
        self.landed = False

    def stream_wait(self, stream: Any = None, layer: int | None = None) -> None:
        self.waited.append(layer)

    def is_done(self) -> bool:
        return self.landed

    def wait(self, timeout: float | None) -> bool:
        self.landed = True
        return True


def as_words(t: torch.Tensor) -> torch.Tensor:
    """Bits of a 16-bit tensor, so NaN patterns compare equal when their bytes do."""
    return t.view(torch.int16)
