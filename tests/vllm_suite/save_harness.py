"""What the save tests share: vLLM's real ``Scheduler`` with kvtier's connector over a small
staging pool, a ``WorkerSide`` over CPU KV tensors laid out as vLLM's CPU backend lays them out,
token ids, and ``SaverGate`` (a call parked on the saver thread, holding it back so a test sees
the state while a save is still pending)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
from scheduler_harness import HEAD_DIM, KV_HEADS, make_kv_cache_config, make_scheduler, make_vllm_config

BLOCK = 32


def saver_scheduler(model: Path, tmp: Path, **extra: Any) -> Any:
    """vLLM's scheduler with kvtier: 64 staging pages, an 8 MiB host tier, a disk tier."""
    config = make_vllm_config(model, {"host_pool_bytes": "8MiB", "staging_pages": 64,
                                      "disk_url": f"file://{tmp / 'disk'}", **extra},
                              block_size=BLOCK, max_batched=256)
    return make_scheduler(config, make_kv_cache_config(BLOCK))


def make_worker(runtime: Any, copy_in_step: bool = False) -> Any:
    """The connector's worker half over random CPU KV tensors (256 blocks a layer)."""
    from kvtier.integrations.vllm.worker import WorkerSide

    worker = WorkerSide(runtime, copy_in_step=copy_in_step)
    kv = {n: torch.randn(256, KV_HEADS, BLOCK, 2 * HEAD_DIM) for n in runtime.shape.layer_names}
    worker.register_kv_caches(kv, "CPU_ATTN")
    return worker


def prompt_ids(n: int, start: int) -> list[int]:
    return [start + i % 900 for i in range(n)]


class SaverGate:
    """Parks the saver thread on a call until ``open`` (``open_all`` when the test ends)."""

    opened: list[SaverGate] = []

    def __init__(self, saver: Any) -> None:
        self.event = threading.Event()
        self.thread = threading.Thread(target=saver.call, args=(self.event.wait,), daemon=True)
        self.thread.start()
        SaverGate.opened.append(self)
        time.sleep(0.05)

    def open(self) -> None:
        self.event.set()
        self.thread.join(10)

    @classmethod
    def open_all(cls) -> None:
        while cls.opened:
            cls.opened.pop().open()
