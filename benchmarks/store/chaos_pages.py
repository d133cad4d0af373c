"""The chaos suite's shared fixtures (``chaos.py``): the fault catalogue (which faults hit a
disk store and which a Redis store, the pages they damage), the tiny model's shape and the
server settings that change KV bytes (``Cfg``), the synthetic pages a served page is checked
against, the chain hashes peers key pages by, the per-fault ``Count``, and the byte-level
tools the faults use (patching a file in place, the older layout, a small tmpfs mount).

Imported by every process of the suite (the parent, each ``--worker`` under its own Python,
each ``--writer``); pure functions called from whichever thread runs a fault. It imports no
kvtier module: the peers' Pythons run it without kvtier on their path."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PAGES = 24
TARGETS = (2, 5, 9, 13)                  # pages a fault damages (where it damages pages)
LAYERS, HEAD_DIM = 2, 32
DTYPE_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}

FILE_FAULTS = ("bit_flip", "zeroed_range", "truncated", "other_page_copied", "kill9_mid_write",
               "stale_older_format", "deleted_index", "deleted_manifest", "other_shape",
               "other_page_size", "other_dtype", "other_tp_size", "fine_tune_same_name",
               "clock_skew", "full_disk", "read_only_disk")
REDIS_FAULTS = ("bit_flip", "zeroed_range", "truncated", "other_page_copied",
                "stale_older_format", "tenant_overwrite", "evicted_mid_read", "restarted_empty",
                "slow_server", "connection_dropped")


@dataclass(frozen=True)
class Cfg:
    """What a server is configured with; every field that changes KV bytes is here."""

    model: str = "tiny-llama"
    weights: str = "base"
    dtype: str = "bfloat16"
    kv_heads: int = 2
    page_tokens: int = 16
    tp: int = 1
    rank: int = 0
    #: Which prompt the pages are of: 0 the shared one; > 0 others; < 0 the kill -9 writer's,
    #: where every page is a one-page prompt of its own.
    prompt: int = 0

    @property
    def full_page_bytes(self) -> int:
        return LAYERS * 2 * self.kv_heads * self.page_tokens * HEAD_DIM * DTYPE_BYTES[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes one rank keeps of a page (a whole page at tp 1)."""
        return self.full_page_bytes // self.tp

    def rank_ranges(self) -> list[tuple[int, int]]:
        """(offset, length) of this rank's heads in a full page laid out
        [layer][k|v][head][token][dim]."""
        head = self.page_tokens * HEAD_DIM * DTYPE_BYTES[self.dtype]
        per = self.kv_heads // self.tp
        return [((block * self.kv_heads + self.rank * per) * head, per * head)
                for block in range(LAYERS * 2)]


BASE = Cfg()


def expected_full(cfg: Cfg, i: int) -> bytes:
    seed = hashlib.sha256(f"{cfg.model}|{cfg.weights}|{cfg.dtype}|{cfg.kv_heads}|"
                          f"{cfg.page_tokens}|{cfg.prompt}|{i}".encode()).digest()
    return np.random.default_rng(int.from_bytes(seed[:8], "little")).bytes(cfg.full_page_bytes)


def expected(cfg: Cfg, i: int) -> bytes:
    full = expected_full(cfg, i)
    if cfg.tp == 1:
        return full
    return b"".join(full[o:o + n] for o, n in cfg.rank_ranges())


@functools.lru_cache(maxsize=8)
def prompt(count: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(7 + seed)
    return tuple(rng.randrange(5, 30000) for _ in range(count))


def isolated(cfg: Cfg) -> bool:
    """Pages of the kill -9 writer: each page a one-page prompt of its own (any number)."""
    return cfg.prompt < 0


def page_tokens(cfg: Cfg, n: int) -> list[int]:
    if isolated(cfg):
        rng = random.Random(n)
        return [rng.randrange(5, 30000) for _ in range(cfg.page_tokens)]
    return list(prompt(PAGES * 32, cfg.prompt)[n * cfg.page_tokens:(n + 1) * cfg.page_tokens])


def chain_hashes(cfg: Cfg, idx: list[int]) -> list[bytes]:
    """Block hashes as vLLM and SGLang make them: a chain over each page's token ids."""
    def step(prev: bytes, page: list[int]) -> bytes:
        return hashlib.sha256(prev + struct.pack(f"<{len(page)}I", *page)).digest()

    if isolated(cfg):
        return [step(b"\0" * 32, page_tokens(cfg, n)) for n in idx]
    out, prev = [], b"\0" * 32
    for n in range(max(idx) + 1):
        prev = step(prev, page_tokens(cfg, n))
        out.append(prev)
    return [out[n] for n in idx]


@dataclass
class Count:
    wrong: int = 0
    refused: int = 0
    errors: int = 0
    lost: int = 0
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(wrong=self.wrong, refused=self.refused, errors=self.errors, lost=self.lost,
                    note=self.note)


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def older_format(page: bytes) -> bytes:
    """The same KV in another byte order (an older layout: 64-byte rows reversed)."""
    rows = [page[o:o + 64] for o in range(0, len(page), 64)]
    return b"".join(reversed(rows))


@contextlib.contextmanager
def tmpfs(scratch: Path, size: str) -> Iterator[Path]:
    mount = Path(tempfile.mkdtemp(dir=scratch))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                   check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
