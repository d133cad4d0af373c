"""kvtier's copy-engine path (``kvtier.transfer.staged``) as ``bench_transfer.py`` drives it.

``staged_fns`` builds a ``Setup``'s load and store through ``StagedCopier`` with the product's
default staging (64 MiB per direction, so a 1 GiB batch goes through in chunks), enqueued on the
caller's current stream; ``staged_rows`` checks the bytes once and times each direction.
Main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.config import HostConfig
from kvtier.transfer.staged import StagedCopier

STAGING_BYTES = HostConfig().copy_staging_bytes


def staged_fns(setup: Any, batch: Any, staging_bytes: int = STAGING_BYTES,
               ) -> tuple[Callable[[], None], Callable[[], None], int]:
    """(load, store, staging bytes) of ``setup``'s batches on kvtier's copy-engine path."""
    geo = setup.load.src
    copiers = {direction: StagedCopier(
        setup.dev.kv, setup.host.buffer, geo,
        torch.empty(staging_bytes, dtype=torch.uint8, device=setup.dev.kv.device), batch)
        for direction in ("load", "store")}
    return (lambda: copiers["load"].run(setup.load), lambda: copiers["store"].run(setup.store),
            2 * staging_bytes)


def check_staged(setup: Any, load: Callable[[], None], store: Callable[[], None]) -> None:
    """Raise unless one load and one store moved every byte where it belongs."""
    plan_l, plan_s, pool, host = setup.load, setup.store, setup.dev.kv, setup.host
    pool.view(torch.uint8).fill_(0)
    checked = (0, setup.n // 2, setup.n - 1)
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


def staged_rows(setup: Any, batch: Any, peak: dict[str, float], reps: int,
                staging_bytes: int = STAGING_BYTES) -> list[dict[str, Any]]:
    """One row per direction for kvtier's copy-engine path (after a byte check)."""
    from transfer_baselines import gpu_time, row

    kib = setup.layout.part_bytes // 1024
    try:
        with torch.cuda.stream(torch.cuda.Stream()):  # batched copies refuse the legacy stream
            load, store, staging = staged_fns(setup, batch, staging_bytes)
            check_staged(setup, load, store)
            label = f"kvtier copy-engine path ({staging >> 20} MiB device staging)"
            return [row(kib, "load", label, setup.load.nbytes, gpu_time(load, reps),
                        peak["h2d_gbs"]),
                    row(kib, "store", label, setup.store.nbytes, gpu_time(store, reps),
                        peak["d2h_gbs"])]
    except Exception as exc:
        return [{"part_kib": kib, "direction": "staged", "method": "kvtier copy-engine path",
                 "error": repr(exc)}]
