"""The chaos suite's disk faults (``chaos.py``): each of ``FILE_FAULTS`` driven through one
system's driver (``fault_file``): bytes damaged in place, a lost index or manifest, a server
restarted with another shape / page size / dtype / TP size / fine-tune, clock skew; kill -9 of a
writer mid-write (``writer_main`` is that writer, started as ``chaos.py --writer``); a full and a
read-only disk (small tmpfs mounts, root only). ``run_file_faults`` runs them all for one
system, each in a fresh directory.

Runs in a disk system's ``--worker`` process (``kvtier-file`` or a peer's, under that peer's
Python) on its main thread; ``writer_main`` runs in the ``--writer`` processes it starts and
kills."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from chaos_driver import Adapter, fresh, reopen_and_score, score
from chaos_kvtier import KvtierFile, KvtierRedis
from chaos_pages import (
    BASE,
    FILE_FAULTS,
    PAGES,
    TARGETS,
    Count,
    expected,
    older_format,
    patch,
    tmpfs,
)
from chaos_peers import LmcacheDisk, SglangFile, VllmFs

#: The script the kill -9 fault starts its writers with (``chaos.py --writer``).
SCRIPT = str(Path(__file__).with_name("chaos.py"))


def fault_file(ad: Adapter, fault: str, root: Path, scratch: Path) -> Count:
    if fault == "kill9_mid_write":
        return _kill9(ad, root)
    if fault == "full_disk":
        return _full_disk(ad, scratch)
    if fault == "read_only_disk":
        return _read_only(ad, scratch)
    fresh(ad, root)
    damaged: set[int] = set(TARGETS)
    if fault == "bit_flip":
        for i in TARGETS:
            path, off, n = ad.locate(root, BASE, i)
            data = bytearray(path.read_bytes()[off + n // 3:off + n // 3 + 1])
            patch(path, off + n // 3, bytes([data[0] ^ 0x10]))
    elif fault == "zeroed_range":
        for i in TARGETS:
            path, off, _ = ad.locate(root, BASE, i)
            patch(path, off + 1024, bytes(512))
    elif fault == "truncated":
        damaged = ad.truncate(root, BASE, TARGETS)
    elif fault == "other_page_copied":
        for i in TARGETS:
            path, off, n = ad.locate(root, BASE, i)
            src, soff, _ = ad.locate(root, BASE, i + 1)
            with open(src, "rb") as f:
                f.seek(soff)
                payload = f.read(n)
            patch(path, off, payload)
    elif fault == "stale_older_format":
        for i in TARGETS:
            ad.rewrite_older_format(root, BASE, i, older_format(expected(BASE, i)))
    elif fault in ("deleted_index", "deleted_manifest"):
        patterns = ad.index_files if fault == "deleted_index" else ad.manifest_files
        if not patterns:
            return Count(note="n/a")
        for pattern in patterns:
            for path in root.glob(pattern):
                path.unlink()
        damaged = set()
    elif fault == "clock_skew":
        damaged = set()
        now = time.time()
        for n, path in enumerate(sorted(root.rglob("*"))):
            stamp = now + 10 * 365 * 86400 if n % 2 else 1.0  # ten years ahead, or 1970
            os.utime(path, (stamp, stamp))
        h = ad.open(root, BASE)  # and the store keeps working: new pages go in and come out
        more = replace(BASE, prompt=1)
        ok = ad.put(h, more, list(range(4)), [expected(more, i) for i in range(4)])
        c2 = score(ad, h, more, set(), idx=[i for i in range(4) if ok[i]])
        ad.close(h)
        c = reopen_and_score(ad, root, BASE, damaged)
        c.wrong += c2.wrong
        c.errors += c2.errors
        c.lost += c2.lost
        return c
    else:
        new = {"other_shape": replace(BASE, kv_heads=4),
               "other_page_size": replace(BASE, page_tokens=32),
               "other_dtype": replace(BASE, dtype="float8_e4m3fn"),
               "other_tp_size": replace(BASE, tp=2, rank=0),
               "fine_tune_same_name": replace(BASE, weights="tuned")}[fault]
        if fault == "other_tp_size" and not ad.restart_forgets:  # right for a TP 2 rank
            c = reopen_and_score(ad, root, new, set(), reusable=False)
            c.note = (c.note + " " if c.note else "") + f"{PAGES - c.refused} served"
            return c
        c = reopen_and_score(ad, root, new, set(range(PAGES)), reusable=False)
        if ad.restart_forgets:
            c.note = "a new server's index starts empty: nothing on disk is found"
        return c
    return reopen_and_score(ad, root, BASE, damaged)


def _kill9(ad: Adapter, root: Path, rounds: int = 4) -> Count:
    total = Count()
    acked: set[int] = set()
    tried: set[int] = set()
    rng = random.Random(11)
    for r in range(rounds):
        start = r * 1000
        proc = subprocess.Popen([sys.executable, SCRIPT, "--writer", ad.name, "--root",
                                 str(root), "--start", str(start)],
                                stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "open\n", line
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        lines = [ln for ln in out.splitlines(keepends=True) if ln.endswith("\n")]
        acked |= {int(x) for ln in lines for x in ln.split()}
        tried |= set(range(start, max(acked | {start}) + 8))
    cfg = replace(BASE, prompt=-1)
    h = ad.open(root, cfg)
    order = sorted(tried)
    for at in range(0, len(order), 64):
        chunk = order[at:at + 64]
        got = ad.get(h, cfg, chunk)
        for i, page in zip(chunk, got, strict=True):
            if page is None:
                if i in acked:
                    total.lost += 1
            elif page != expected(cfg, i):
                total.wrong += 1
    ad.close(h)
    total.note = f"{len(acked)} acknowledged over {rounds} kills"
    return total


def writer_main(system: str, root: Path, start: int) -> None:
    """Write pages in batches forever, printing the acknowledged ones (killed by the parent)."""
    scratch = root.parent / f"writer-{start}"
    scratch.mkdir(exist_ok=True)
    ad = adapter(system, scratch)
    cfg = replace(BASE, prompt=-1)
    h = ad.open(root, cfg)
    print("open", flush=True)
    i = start
    while True:
        idx = list(range(i, i + 4))
        ok = ad.put(h, cfg, idx, [expected(cfg, n) for n in idx])
        print(" ".join(str(n) for n, a in zip(idx, ok, strict=True) if a), flush=True)
        i += 4


def _full_disk(ad: Adapter, scratch: Path) -> Count:
    if os.geteuid() != 0:
        return Count(note="skipped: mounting a small tmpfs needs root")
    c = Count()
    with tmpfs(scratch, "256k") as root:
        h = ad.open(root, BASE)
        acked: set[int] = set()
        for i in range(PAGES):  # 24 pages of 8 KiB + metadata into 256 KiB ... then past it
            try:
                ok = ad.put(h, BASE, [i], [expected(BASE, i)])
            except Exception as exc:
                c.errors += 1
                c.note = f"write: {type(exc).__name__}"
                continue
            if ok[0]:
                acked.add(i)
        filler = root / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            f.write(bytes(1 << 20))  # whatever room is left, taken by another program
        more = replace(BASE, prompt=2)
        try:
            ok = ad.put(h, more, list(range(4)), [expected(more, n) for n in range(4)])
            refused_writes = ok.count(False)
        except Exception as exc:
            c.errors += 1
            c.note = f"write when full: {type(exc).__name__}"
            refused_writes = 4
        ad.close(h)
        got = reopen_and_score(ad, root, BASE, set(range(PAGES)) - acked)
        c.wrong, c.lost = got.wrong, got.lost
        c.errors += got.errors
        c.refused = got.refused
        c.note = (c.note + "; " if c.note else "") + (
            f"{len(acked)} of {PAGES} acknowledged; {refused_writes}/4 writes refused when full")
    return c


def _read_only(ad: Adapter, scratch: Path) -> Count:
    if os.geteuid() != 0:
        return Count(note="skipped: remounting read-only needs root")
    with tmpfs(scratch, "16m") as root:
        fresh(ad, root)
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        c = reopen_and_score(ad, root, BASE, set())
        try:
            h = ad.open(root, BASE)
            more = replace(BASE, prompt=3)
            ok = ad.put(h, more, list(range(4)), [expected(more, n) for n in range(4)])
            c.note = f"{ok.count(False)}/4 new writes refused"
            ad.close(h)
        except Exception as exc:
            c.errors += 1
            c.note = f"write: {type(exc).__name__}: {exc}"[:160]
    return c


def adapter(system: str, scratch: Path, server: Any = None) -> Adapter:
    if system == "kvtier-file":
        return KvtierFile(scratch)
    if system == "kvtier-redis":
        return KvtierRedis(scratch, server)
    if system == "vllm-fs":
        return VllmFs()
    if system == "sglang-file":
        return SglangFile()
    if system == "lmcache-disk":
        return LmcacheDisk()
    raise SystemExit(f"unknown system {system}")


def run_file_faults(system: str, faults: tuple[str, ...] = FILE_FAULTS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        ad = adapter(system, scratch)
        for fault in faults:
            root = scratch / fault
            root.mkdir()
            try:
                out[fault] = fault_file(ad, fault, root, scratch).as_dict()
            except Exception as exc:
                out[fault] = Count(errors=-1, note=f"harness: {type(exc).__name__}: {exc}"
                                   ).as_dict()
    return out
