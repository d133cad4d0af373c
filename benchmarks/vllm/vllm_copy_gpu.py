"""Loading a prefix's KV from kvtier's pinned host tier into vLLM-shaped KV tensors, per layout.

For each memory order of vLLM's per-layer ``[blocks, heads, tokens, K|V]`` tensor (``nhd``:
tokens outer, vLLM's default; ``hnd``: heads outer), block size (kvtier's page size equal to it)
and prefix length, side by side in one run:

- ``pinned copy_``: one ``Tensor.copy_`` per layer of the same bytes from a contiguous buffer
  of torch's pinned memory to a contiguous device buffer: the pinned PCIe rate, the baseline of
  every ratio;
- ``connector``: the path of a host hit in kvtier's vLLM connector: the scheduler half's
  ``TieredCache.load(..., overlap=True)`` (kvtier's copy engine, host pages -> kvtier's device
  pool, one launch and one event per layer on its load stream, left in flight) and then the
  worker half's ``wait_for_layer_load`` for every layer (the forward's stream waits for that
  layer's event, then ``integrations.vllm.blocks`` copies pool pages -> vLLM blocks, one launch per layer),
  so the device-to-device copies overlap the bus copy of the layers after them;
- ``connector, serial``: the path before the overlap: the whole load in one launch, and the
  worker's copies only after it;
- ``connector, wide load``: the same with the load's per-layer launches on the kernels'
  default grid (one program per multiprocessor) rather than the small grid of layer-by-layer
  loads, which leaves the SMs to the forward they overlap;
- ``connector, copy engines``: the same with the load through the GPU's copy engines
  (``host.copy_path: copy_engine``: each page's layer as one copy-engine copy into a device
  staging buffer, then scattered into the pool device to device), no multiprocessor on the bus;
- ``connector, N/SM``: the same with the worker's copies on N programs per multiprocessor
  (the worker runs ``vllm.blocks.DEVICE_PROGRAMS_PER_SM``);
- ``connector, torch rows``: the same with the worker's copy done by torch indexing by slot
  (what the worker does where the kernels do not apply);
- ``direct, N/SM`` and ``direct, copy engines``: the direct path's load (``vllm.direct``), the
  row kernel reading pinned host pages straight into vLLM's blocks on N programs per SM, or
  (its default on CUDA, ``BounceLoads``) the copy engines into a 64 MiB device buffer and the
  row kernel from there, chunk by chunk.

Pages, pool pages and blocks are scattered (random permutations). ``load ms`` is the
TTFT-shaped figure: from the first copy until every layer of the prefix sits in vLLM's tensors
(median of ``--repeats`` runs after a warm-up); ``GB/s`` is the prefix's KV bytes over it and
``ratio`` that rate over the pinned ``copy_`` rate of the same run (goal: >= 0.90 at 16-token
blocks). ``issue ms`` is the time the calling thread spent issuing the path (plans, id
uploads, launches; on the GPU the copies run behind it). ``exact`` compares every block of
every layer with the host pages as 16-bit words, after the tensors were zeroed before the path
ran.

On a GPU: ``PYTHONPATH=src python3 benchmarks/vllm/vllm_copy_gpu.py --json $OUT/copy.json``
(llama3-8b's KV: 32 layers, 8 KV heads x 128, bf16; 4k and 32k tokens). ``--device cpu``
(tiny shapes, TRITON_INTERPRET=1, no pinned memory) checks the script and exactness only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.machine import format_table, write_report

GB = 1e9
#: Grids (programs per multiprocessor) of the worker's pool -> block copies, each a row of its
#: own beside the worker's (``vllm.blocks.DEVICE_PROGRAMS_PER_SM``, chosen from this comparison).
OTHER_PROGRAMS_PER_SM = (1, 2, 4)
#: The connector path's rate over the pinned ``copy_`` rate it should reach (issue #19).
GOAL_RATIO = 0.90


class Clock:
    """Wall time of a piece of device work (CUDA events, or the CPU's clock)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, work: Callable[[], None]) -> tuple[float, float]:
        """Seconds until the work landed, and seconds the calling thread spent issuing it."""
        if not self.cuda:
            start = time.perf_counter()
            work()
            spent = time.perf_counter() - start
            return spent, spent
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        work()
        issued = time.perf_counter() - start
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3, issued


class Setup:
    """One block size and prefix: kvtier's host pool and device pool, the ids of a hit."""

    def __init__(self, args: argparse.Namespace, block: int, prefix: int,
                 device: torch.device, page: int | None = None) -> None:
        from kvtier.layout import KVLayout
        from kvtier.memory import HostPool, PinnedBudget
        from kvtier.memory.device_pool import DevicePool
        from kvtier.transfer.copy_engine import CopyEngine
        from kvtier.transfer.kernels import KernelConfig

        self.block, self.device = block, device
        self.page = page or block                    # kvtier's page: a multiple of the block
        self.per_page = self.page // block
        self.layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.dtype, self.page)
        self.dtype = getattr(torch, args.dtype)
        self.pages = prefix // self.page
        self.num_blocks = prefix // block + args.spare_blocks
        spare = self.pages + max(1, args.spare_blocks // self.per_page)
        self.host = HostPool(self.layout, spare, PinnedBudget(spare * self.layout.page_bytes),
                             host_layout="page_first")
        gen = torch.Generator().manual_seed(block * 7919 + prefix + self.page)
        self.host_ids = torch.randperm(spare, generator=gen)[: self.pages].numpy()
        self.pool_ids = torch.randperm(spare, generator=gen)[: self.pages].numpy()
        self.block_ids = torch.randperm(self.num_blocks, generator=gen)[
            : self.pages * self.per_page].numpy()
        fill = torch.randint(-2**15, 2**15, (self.host.buffer.numel() // 2,), dtype=torch.int16,
                             device=device)
        self.host.buffer.view(torch.int16).copy_(fill)
        del fill
        self.device_pool = DevicePool(self.layout, spare, device)
        self.pool = self.device_pool.kv
        #: kvtier's copy engine over both pools: the scheduler half's ``TieredCache.load``.
        self.engine = CopyEngine(self.device_pool, self.host)
        #: The same with the load's launches on the kernels' default grid instead of the
        #: layer-by-layer loads' small one (``copy_engine.LAYERWISE_LOAD_PROGRAMS``).
        self.wide_engine = CopyEngine(self.device_pool, self.host, load_config=KernelConfig())
        #: The same load through the GPU's copy engines (``host.copy_path: copy_engine``): whole
        #: page-and-layer ranges into a device staging buffer, scattered device to device.
        self.ce_engine = CopyEngine(self.device_pool, self.host, path="copy_engine")
        self.nbytes = self.pages * self.layout.page_bytes
        #: The baseline's source: the same byte count in torch's own pinned memory.
        self.pinned = torch.empty(args.layers, self.nbytes // args.layers, dtype=torch.uint8,
                                  pin_memory=device.type == "cuda")

        #: The host pages' bytes as the device holds them, to check results against.
        self.reference = self.host.buffer.to(device).view(torch.int16).view(
            spare, args.layers, 2, self.page, args.kv_heads, args.head_dim)

    def close(self) -> None:
        self.host.close()


#: The attention backend each memory order stands for (any of vLLM's packed backends reads alike).
BACKENDS = {"nhd": "FLASH_ATTN", "hnd": "FLASHINFER"}


def vllm_tensors(setup: Setup, kind: str) -> list[torch.Tensor]:
    """One ``[blocks, heads, tokens, 2 * head_dim]`` tensor per layer, in ``kind``'s order."""
    lay, n, b = setup.layout, setup.num_blocks, setup.block
    h, d = lay.num_kv_heads, lay.head_dim
    out = []
    for _ in range(lay.num_layers):
        if kind == "nhd":
            kv = torch.zeros(n, b, h, 2 * d, dtype=setup.dtype, device=setup.device)
            out.append(kv.permute(0, 2, 1, 3))
        else:
            out.append(torch.zeros(n, h, b, 2 * d, dtype=setup.dtype, device=setup.device))
    return out


def tensor_layout(setup: Setup, kind: str, kv: list[torch.Tensor]) -> Any:
    from kvtier.integrations.vllm.layout import block_layout

    lay = setup.layout
    return block_layout(BACKENDS[kind], kv[0], lay.num_kv_heads, lay.head_dim, setup.block)


def coarse_paths(setup: Setup, kind: str, kv: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    """kvtier pages of ``setup.page`` tokens into ``setup.block``-token vLLM blocks: the
    connector's path, its load on the kernels or on the copy engines, then whole blocks out of
    the pool's sub-pages (``vllm.blocks.block_view``)."""
    from kvtier.integrations.vllm.blocks import BlockCopier, block_view, sub_pages

    lay, dev = setup.layout, setup.device
    layout = tensor_layout(setup, kind, kv)
    copier = BlockCopier.for_device_pool(layout, block_view(setup.pool, setup.block))
    subs = sub_pages(torch.from_numpy(setup.pool_ids), setup.page, setup.block).numpy()
    baseline_dst = torch.empty_like(setup.pinned, device=dev)

    def pinned() -> None:
        for layer in range(lay.num_layers):
            baseline_dst[layer].copy_(setup.pinned[layer], non_blocking=True)

    def through_pool(engine: Any) -> Callable[[], None]:
        def run() -> None:
            ticket = engine.load_layerwise(setup.host_ids, setup.pool_ids)
            plan = copier.plan("load", subs, setup.block_ids)
            ids = copier.ids(plan, dev)
            for layer, tensor in enumerate(kv):
                ticket.stream_wait(layer=layer)
                copier.copy(plan, layer, tensor, ids)
        return run

    name = f"connector, {setup.page}-token pages"
    return {"pinned copy_": pinned, name: through_pool(setup.engine),
            f"{name}, copy engines": through_pool(setup.ce_engine)}


def paths(setup: Setup, kind: str, kv: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    """Each path's work: the whole prefix into ``kv``, layer by layer."""
    from kvtier.integrations.vllm.blocks import DEVICE_PROGRAMS_PER_SM, BlockCopier
    from kvtier.integrations.vllm.direct import BounceLoads, host_kv
    from kvtier.transfer.ce_batch import host_memmove, load_batch_copy
    from kvtier.transfer.kernels import PreparedCopy
    from kvtier.transfer.plan import device_geometry, host_geometry, make_plan

    lay, dev = setup.layout, setup.device
    layout = tensor_layout(setup, kind, kv)
    host_geo = host_geometry(lay, setup.host.num_pages, "page_first")
    pool_geo = device_geometry(lay, setup.pool.shape[2])
    host = setup.host.buffer
    stage = PreparedCopy(make_plan("load", host_geo, pool_geo, setup.host_ids, setup.pool_ids),
                         setup.pool, host)
    from_pool = BlockCopier.for_device_pool(layout, setup.pool)
    grids = {f"connector, {n}/SM": BlockCopier.for_device_pool(layout, setup.pool, n)
             for n in OTHER_PROGRAMS_PER_SM if n != DEVICE_PROGRAMS_PER_SM}
    block = setup.block
    tokens = torch.arange(setup.pages * block)
    rows = (torch.from_numpy(setup.pool_ids)[tokens // block] * block + tokens % block).to(dev)
    slots = (torch.from_numpy(setup.block_ids)[tokens // block] * block + tokens % block).to(dev)
    flat = setup.pool.view(lay.num_layers, 2, -1, lay.num_kv_heads, lay.head_dim)
    baseline_src = setup.pinned
    baseline_dst = torch.empty_like(baseline_src, device=dev)

    def pinned() -> None:
        for layer in range(lay.num_layers):
            baseline_dst[layer].copy_(baseline_src[layer], non_blocking=True)

    def through_pool(copier: BlockCopier, engine: Any = setup.engine) -> Callable[[], None]:
        def run() -> None:          # the scheduler's load, then wait_for_layer_load per layer
            ticket = engine.load_layerwise(setup.host_ids, setup.pool_ids)
            plan = copier.plan("load", setup.pool_ids, setup.block_ids)
            ids = copier.ids(plan, dev)
            for layer, tensor in enumerate(kv):
                ticket.stream_wait(layer=layer)
                copier.copy(plan, layer, tensor, ids)
        return run

    def serial(copier: BlockCopier) -> Callable[[], None]:
        def run() -> None:          # the whole load in one launch, then the worker's copies
            stage.launch()
            plan = copier.plan("load", setup.pool_ids, setup.block_ids)
            ids = copier.ids(plan, dev)
            for layer, tensor in enumerate(kv):
                copier.copy(plan, layer, tensor, ids)
        return run

    def torch_rows() -> None:
        stage.launch()
        for layer, tensor in enumerate(kv):
            layout.write(tensor, slots, flat[layer, 0][rows], flat[layer, 1][rows])

    def direct(programs: int) -> Callable[[], None]:
        copier = BlockCopier(layout, host_kv(setup.host), programs, device=dev)

        def run() -> None:          # the direct path's load: host pages -> blocks, one launch
            plan = copier.plan("load", setup.host_ids, setup.block_ids)
            copier.copy_layers(plan, kv, copier.ids(plan, dev))
        return run
    batch = load_batch_copy() if dev.type == "cuda" else host_memmove()
    bounce = BounceLoads(setup.host, layout, kv, batch, 64 << 20) if batch else None
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def bounced() -> None:  # on a stream of its own, as the path runs (not the legacy default)
        if side is None:
            return bounce.load(setup.host_ids, setup.block_ids)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            bounce.load(setup.host_ids, setup.block_ids)
        torch.cuda.current_stream(dev).wait_stream(side)
    return {"pinned copy_": pinned, "connector": through_pool(from_pool),
            **{name: through_pool(copier) for name, copier in grids.items()},
            "connector, serial": serial(from_pool),
            "connector, wide load": through_pool(from_pool, setup.wide_engine),
            "connector, copy engines": through_pool(from_pool, setup.ce_engine),
            "connector, torch rows": torch_rows,
            **({f"direct, {n}/SM": direct(n) for n in (1, 2, 4, 8)}
               if setup.host.pinned or dev.type != "cuda" else {}),
            **({"direct, copy engines": bounced} if bounce is not None else {})}


def exact(setup: Setup, kind: str, kv: list[torch.Tensor]) -> bool:
    k = setup.per_page
    layout = tensor_layout(setup, kind, kv)
    pages = torch.from_numpy(setup.host_ids).to(setup.device).repeat_interleave(k)
    within = torch.arange(k, device=setup.device).repeat(setup.pages)
    blocks = torch.from_numpy(setup.block_ids).to(setup.device)
    reference = setup.reference.unflatten(3, (k, setup.block))   # [pages, L, 2, k, block, ...]
    for layer, tensor in enumerate(kv):
        keys, values = layout.read_blocks(tensor, blocks)
        expected = reference[pages, layer, :, within]              # [blocks, 2, block, ...]
        if not (torch.equal(keys.view(torch.int16), expected[:, 0])
                and torch.equal(values.view(torch.int16), expected[:, 1])):
            return False
    return True


def measure(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    clock, rows = Clock(device), []
    cases = [(b, p, page) for b in args.blocks for p in args.prefixes
             for page in sorted({b, *(args.coarse_pages or [])}) if page >= b and page % b == 0]
    for block, prefix, page in cases:
        setup = Setup(args, block, prefix, device, page)
        for kind in args.layouts:
            kv = vllm_tensors(setup, kind)
            results: dict[str, float] = {}
            which = paths if page == block else coarse_paths
            for name, work in which(setup, kind, kv).items():
                for tensor in kv:
                    tensor.zero_()
                clock.time(work)                       # warm-up (and kernel compile)
                runs = [clock.time(work) for _ in range(args.repeats)]
                times = [landed for landed, _ in runs]
                seconds = statistics.median(times)
                issue_ms = statistics.median(issued for _, issued in runs) * 1e3
                ok = None if name == "pinned copy_" else exact(setup, kind, kv)
                results[name] = setup.nbytes / seconds / GB
                rows.append({"layout": kind, "block": block, "page": page,
                             "prefix": prefix, "path": name,
                             "host_pool_pinned": setup.host.pinned,
                             "bytes": setup.nbytes, "load_ms": seconds * 1e3,
                             "load_ms_all": [t * 1e3 for t in times],
                             "issue_ms": issue_ms,
                             "gb_per_s": results[name],
                             "ratio": results[name] / results["pinned copy_"],
                             "exact": ok})
            del kv
        setup.close()
        del setup
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layouts", nargs="+", default=["nhd", "hnd"])
    parser.add_argument("--blocks", type=int, nargs="+", default=None)
    parser.add_argument("--prefixes", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--spare-blocks", type=int, default=64,
                        help="blocks (and pages) beyond the prefix, so ids scatter")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--coarse-pages", type=int, nargs="*", default=None,
                        help="kvtier page sizes (multiples of the block) run beside page = block")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    if on_cpu:                      # before Triton's kernels are first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tiny = {"blocks": [16], "prefixes": [64, 256], "layers": 2, "kv_heads": 2, "head_dim": 16,
            "repeats": 2, "coarse_pages": [32]}
    full = {"blocks": [16, 128], "prefixes": [4096, 32768], "layers": 32, "kv_heads": 8,
            "head_dim": 128, "repeats": 5, "coarse_pages": [128]}
    for key, value in (tiny if on_cpu else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    rows = measure(args, device)
    table = format_table(
        ["layout", "block", "page", "prefix", "path", "MiB", "load ms", "issue ms", "GB/s",
         "ratio", "exact"],
        [[r["layout"], r["block"], r["page"], r["prefix"], r["path"], r["bytes"] / 2**20,
          r["load_ms"], r["issue_ms"], r["gb_per_s"], r["ratio"],
          "-" if r["exact"] is None else r["exact"]]
         for r in rows])
    print(table)
    goal = goal_check(rows)
    print(goal["line"])
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        print("wrote", write_report(args.json, "vllm_copy_gpu", {
            "settings": settings, "rows": rows, "goal": goal, "table": table}))


def goal_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per connector configuration, its worst ratio to the pinned ``copy_`` at 16-token blocks
    (goal 0.90), and whether every path was byte-exact. ``connector`` is the default (kvtier
    pages as large as vLLM's blocks, the load on kvtier's kernels); the others are settings a
    user can choose (``page_size``, ``host.copy_path``)."""
    worst: dict[str, float] = {}
    for r in rows:
        if r["block"] == 16 and r["path"].startswith("connector") and "/SM" not in r["path"] \
                and "serial" not in r["path"] and "torch rows" not in r["path"]:
            worst[r["path"]] = min(worst.get(r["path"], r["ratio"]), r["ratio"])
    exact_all = all(r["exact"] is not False for r in rows)
    default = worst.get("connector")
    met = default is not None and default >= GOAL_RATIO and exact_all
    best = max(worst, key=lambda k: worst[k]) if worst else None
    line = (f"goal: connector >= {GOAL_RATIO:.2f} x pinned copy_ at 16-token blocks and "
            f"byte-exact: default {'met' if met else 'not met'} (worst "
            f"{'-' if default is None else f'{default:.3f}'}); best configuration "
            f"{best!r} (worst {worst.get(best, 0.0):.3f}); all exact: {exact_all}")
    return {"ratio": GOAL_RATIO, "worst_connector_ratio_block16": default,
            "worst_by_path_block16": worst, "all_exact": exact_all, "met": met, "line": line}


if __name__ == "__main__":
    main()
