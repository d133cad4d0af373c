"""Copy-engine transfers staged through device memory, for ``bench_transfer.py``.

The copy engines reach the bus's duplex peak only on large contiguous copies, and a UVA kernel in
one direction slows the copy engines in the other. In the ``page_first`` host layout every page
is one contiguous host range, so a batch of scattered pages can cross the bus as one copy-engine
copy per page (``cuMemcpyBatchAsync``) into or out of a dense device staging buffer, and kvtier's
kernel does the scattered part on the device side (device memory to device memory, a few percent
of the time). ``staged_fns`` builds the load and the store of a ``Setup`` that way. Main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.transfer.kernels import launch_copy, upload_ids
from kvtier.transfer.plan import host_geometry, make_plan
from transfer_baselines import ce_batch_copy


def _page_addresses(base: int, ids: np.ndarray, stride: int) -> np.ndarray:
    return np.uint64(base) + ids.astype(np.uint64) * np.uint64(stride)


def staged_fns(setup: Any, ce: Any) -> tuple[Callable[[], None], Callable[[], None], int]:
    """(load, store, staging bytes): each copies ``setup``'s batch through a device staging
    buffer, the copy engines on the bus side and kvtier's kernel on the device side, on the
    current stream."""
    layout, n = setup.layout, setup.n
    if setup.host.host_layout != "page_first":
        raise ValueError("staged copies need the page_first host layout")
    page = layout.page_bytes
    stage_geo = host_geometry(layout, n, "page_first")
    dense = np.arange(n, dtype=np.int64)
    stage_load = torch.empty(n * page, dtype=torch.uint8, device="cuda")
    stage_store = torch.empty(n * page, dtype=torch.uint8, device="cuda")
    host_base = setup.host.buffer.data_ptr()
    sizes = np.full(n, page, dtype=np.uint64)

    scatter = make_plan("load", stage_geo, setup.load.dst, dense, setup.load.dst_ids)
    scatter_ids = upload_ids(scatter, setup.dev.kv.device)
    load_arrays = (_page_addresses(stage_load.data_ptr(), dense, page),
                   _page_addresses(host_base, setup.load.src_ids, page), sizes)

    gather = make_plan("store", setup.store.src, stage_geo, setup.store.src_ids, dense)
    gather_ids = upload_ids(gather, setup.dev.kv.device)
    store_arrays = (_page_addresses(host_base, setup.store.dst_ids, page),
                    _page_addresses(stage_store.data_ptr(), dense, page), sizes)

    def load() -> None:
        ce_batch_copy(ce, load_arrays, torch.cuda.current_stream().cuda_stream)
        launch_copy(scatter, setup.dev.kv, stage_load, None, ids=scatter_ids)

    def store() -> None:
        launch_copy(gather, setup.dev.kv, stage_store, None, ids=gather_ids)
        ce_batch_copy(ce, store_arrays, torch.cuda.current_stream().cuda_stream)

    return load, store, 2 * n * page


def check_staged(setup: Any, load: Callable[[], None], store: Callable[[], None]) -> None:
    """Raise unless one staged load and one staged store moved every byte where it belongs."""
    plan_l, plan_s, pool, host = setup.load, setup.store, setup.dev.kv, setup.host
    pool.view(torch.uint8).fill_(0)
    checked = (0, setup.n - 1)
    for i in checked:
        page = host.page(int(plan_l.src_ids[i]))
        page.copy_(torch.randint(0, 255, page.shape, dtype=torch.uint8))
    load()
    torch.cuda.synchronize()
    for i in checked:
        got = pool[:, :, int(plan_l.dst_ids[i])].contiguous().view(torch.uint8).reshape(-1).cpu()
        if not torch.equal(got, host.page(int(plan_l.src_ids[i])).reshape(-1)):
            raise AssertionError(f"staged load put wrong bytes in device page {plan_l.dst_ids[i]}")
    store()
    torch.cuda.synchronize()
    for i in checked:
        want = pool[:, :, int(plan_s.src_ids[i])].contiguous().view(torch.uint8).reshape(-1).cpu()
        if not torch.equal(host.page(int(plan_s.dst_ids[i])).reshape(-1), want):
            raise AssertionError(f"staged store put wrong bytes in host page {plan_s.dst_ids[i]}")


def staged_rows(setup: Any, ce: Any, peak: dict[str, float], reps: int) -> list[dict[str, Any]]:
    """One row per direction for the staged copy-engine path (after a byte check)."""
    from transfer_baselines import gpu_time, row

    kib = setup.layout.part_bytes // 1024
    try:
        with torch.cuda.stream(torch.cuda.Stream()):  # batched copies refuse the legacy stream
            load, store, staging = staged_fns(setup, ce)
            check_staged(setup, load, store)
            label = f"copy engines staged ({staging >> 20} MiB device staging)"
            return [row(kib, "load", label, setup.load.nbytes, gpu_time(load, reps),
                        peak["h2d_gbs"]),
                    row(kib, "store", label, setup.store.nbytes, gpu_time(store, reps),
                        peak["d2h_gbs"])]
    except Exception as exc:
        return [{"part_kib": kib, "direction": "staged", "method": "staged copy engines",
                 "error": repr(exc)}]
