"""The chaos suite's end-to-end check (``chaos.py``): the engine a ``kvtier serve`` runs
(embedded tiny-llama, CPU) answers prompts with a disk tier and stops; each of
``SERVE_FAULTS`` damages its disk directory (every record of the store, found by its header);
a server restarted on that directory must answer as ``--no-cache`` does (``run_server_faults``:
wrong answers, errors, prompt tokens served from disk).

Runs in the ``kvtier-serve`` ``--worker`` process (or a test) on its main thread, which submits
each prompt and waits for its answer; each ``EngineService`` runs its engine on threads of its
own."""

from __future__ import annotations

import contextlib
import os
import random
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos_kvtier import KvtierFile
from chaos_pages import Count, patch, tmpfs

SERVE_FAULTS = ("bit_flip", "zeroed_range", "truncated", "other_page_copied",
                "stale_older_format", "deleted_index", "fine_tune_same_name", "clock_skew",
                "read_only_disk")


def _records(root: Path) -> list[tuple[Path, int, int, int]]:
    """Every record of a kvtier disk store: (segment, header offset, payload offset, length)."""
    import zlib

    out = []
    for seg in sorted((root / "segments").glob("*.seg")):
        data = seg.read_bytes()
        at = data.find(b"KVTR")
        while at >= 0:
            head = data[at:at + 64]
            if len(head) == 64 and zlib.crc32(head[:60]) == struct.unpack("<I", head[60:])[0]:
                _, _, _, place, length, _, _ = struct.unpack("<4sHHIQQ32s", head[:60])
                out.append((seg, at, place * 512, length))
            at = data.find(b"KVTR", at + 1)
    return out


def _damage_store(fault: str, root: Path) -> None:
    import zlib

    records = _records(root)
    for n, (seg, head, off, length) in enumerate(records):
        if fault == "bit_flip":
            with open(seg, "r+b") as f:
                f.seek(off + length // 3)
                byte = f.read(1)[0]
                f.seek(off + length // 3)
                f.write(bytes([byte ^ 0x10]))
        elif fault == "zeroed_range":
            patch(seg, off + length // 4, bytes(min(512, length // 2)))
        elif fault == "other_page_copied" and len(records) > 1:
            src, _, soff, _ = records[(n + 1) % len(records)]
            with open(src, "rb") as f:
                f.seek(soff)
                patch(seg, off, f.read(length))
        elif fault == "stale_older_format":
            body = bytearray(seg.read_bytes()[head:head + 60])
            body[4:6] = struct.pack("<H", 0)
            patch(seg, head, bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))))
    if fault == "truncated":
        for seg in sorted((root / "segments").glob("*.seg")):
            os.truncate(seg, seg.stat().st_size // 2)
    elif fault == "deleted_index":
        for pattern in KvtierFile.index_files:
            for path in root.glob(pattern):
                path.unlink()
    elif fault == "clock_skew":
        for n, path in enumerate(sorted(root.rglob("*"))):
            stamp = time.time() + 10 * 365 * 86400 if n % 2 else 1.0
            os.utime(path, (stamp, stamp))


def _serve_prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(320)]
    return [shared[:rng.randrange(200, 320)] + [rng.randrange(5, 1000) for _ in range(40)]
            for _ in range(6)]


def _service(disk: Path | None, seed: int, cache: bool = True) -> Any:
    from kvtier.config import build_config
    from kvtier.engine.service import EngineService

    flags = {"engine.model": "tiny-llama", "engine.device": "cpu", "engine.dtype": "float32",
             "engine.seed": str(seed), "cache.enabled": str(cache).lower(),
             "cache.page_size": "16", "host.pool_bytes": "8MiB" if cache else "0",
             "controller.min_prefetch_tokens": "0",
             "controller.prefetch_policy": "wait_complete",
             "store.disk_url": f"file://{disk}" if disk else ""}
    return EngineService.build(build_config(env={}, flags=flags), max_running=1)


def _answers(service: Any, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    from kvtier.engine.request import GenerationRequest

    out, disk_tokens = [], 0
    for prompt in batch:
        tokens, finish = service.submit(GenerationRequest(tuple(prompt), 12)).result(timeout=600)
        out.append(list(tokens))
        disk_tokens += finish.prefill.cached_by_tier.get("disk", 0)
    return out, disk_tokens


def run_server_faults(faults: tuple[str, ...] = SERVE_FAULTS) -> dict[str, Any]:
    """Per fault: a server with a disk tier answers the prompts and stops (its writes
    flushed); the fault hits its disk directory; a restarted server answers them again.
    ``wrong``: answers unlike ``--no-cache``'s; ``refused``: prompts that got no disk hit."""
    prompts_ = _serve_prompts()
    wants = {}
    for seed in (0, 1):
        plain = _service(None, seed, cache=False)
        try:
            wants[seed] = _answers(plain, prompts_)[0]
        finally:
            plain.close()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fault in ("none", *faults):
            if fault == "read_only_disk" and os.geteuid() != 0:
                out[fault] = Count(note="skipped: remounting read-only needs root").as_dict()
                continue
            with contextlib.ExitStack() as stack:
                root = (stack.enter_context(tmpfs(Path(tmp), "4g")) if fault ==
                        "read_only_disk" else Path(tmp) / fault) / "disk"
                first = _service(root, 0)
                try:
                    _answers(first, prompts_)
                finally:
                    first.close()
                if fault == "read_only_disk":
                    subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
                else:
                    _damage_store(fault, root)
                seed = 1 if fault == "fine_tune_same_name" else 0
                c = Count()
                try:
                    again = _service(root, seed)
                    try:
                        got, disk_tokens = _answers(again, prompts_)
                    finally:
                        again.close()
                    c.wrong = sum(a != b for a, b in zip(got, wants[seed], strict=True))
                    c.note = f"{disk_tokens} prompt tokens served from disk"
                except Exception as exc:  # an error reached the client
                    c.errors = 1
                    c.note = f"{type(exc).__name__}: {exc}"[:160]
                out[fault] = c.as_dict()
    return out
