"""The chaos suite's drivers of kvtier's own stores (``chaos.py``): ``KvtierFile``, the disk
tier (``file://``) behind the ``StoreGuard`` a cache holds, keyed with ``KeyNamespace`` and the
checkpoint fingerprint of a tiny checkpoint written here (a base and a fine-tune under one
name); ``KvtierRedis``, the Redis store the same way. Each also knows its record layout, so a
fault can find a page's header and payload in a segment file.

Runs in the ``kvtier-file`` / ``kvtier-redis`` / ``kvtier-serve`` workers and the kill -9
``--writer`` process (core venv, kvtier on the path), on their main threads. kvtier is imported
inside the methods: the peers' Pythons import this module without kvtier."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from chaos_driver import Adapter
from chaos_pages import HEAD_DIM, LAYERS, PAGES, Cfg, isolated, page_tokens, patch


class KvtierFile(Adapter):
    name = "kvtier-file"
    index_files = ("HEAD", "journal.*", "snapshot.*")
    manifest_files = ("kvtier-store.json",)

    def __init__(self, scratch: Path) -> None:
        from kvtier.model_identity import checkpoint_fingerprint

        # Two checkpoints of one name written into one directory, one after the other (a
        # fine-tune over its base): the fingerprint is taken from the files each time.
        ckpt = scratch / "checkpoint"
        self.fingerprints = {}
        for weights in ("base", "tuned"):
            tiny_checkpoint(ckpt, weights)
            self.fingerprints[weights] = checkpoint_fingerprint(ckpt)

    def keys(self, cfg: Cfg, idx: list[int]) -> list[bytes]:
        from kvtier.keys import KeyNamespace, page_keys

        ns = KeyNamespace(cfg.model, self.fingerprints[cfg.weights], cfg.dtype,
                          f"L{LAYERS}xK{cfg.kv_heads}xD{HEAD_DIM}", cfg.page_tokens)
        if isolated(cfg):
            return [bytes(page_keys(page_tokens(cfg, n), cfg.page_tokens, ns)[0]) for n in idx]
        chain = page_keys([t for n in range(max(idx) + 1) for t in page_tokens(cfg, n)],
                          cfg.page_tokens, ns)
        return [bytes(chain[n]) for n in idx]

    def open(self, root: Path, cfg: Cfg) -> Any:
        from kvtier.store import open_store
        from kvtier.store.guard import StoreGuard

        url = f"file://{root}"
        return StoreGuard.open("disk", lambda: open_store(url, page_bytes=cfg.full_page_bytes),
                               page_bytes=cfg.full_page_bytes, scheme="file", url=url)

    def put(self, h: Any, cfg: Cfg, idx: list[int], pages: list[bytes]) -> list[bool]:
        return list(h.write(self.keys(cfg, idx), [bytearray(p) for p in pages]))

    def get(self, h: Any, cfg: Cfg, idx: list[int]) -> list[bytes | None]:
        from kvtier.layout import ByteRange

        keys = self.keys(cfg, idx)
        bufs = [bytearray(cfg.page_bytes) for _ in idx]
        if cfg.tp == 1:
            ok = h.read_into(keys, bufs)
        else:  # a rank reads its heads of the layout-neutral page
            ranges = [ByteRange(o, n) for o, n in cfg.rank_ranges()]
            ok = h.read_ranges_into(keys, ranges, bufs)
        return [bytes(b) if hit else None for b, hit in zip(bufs, ok, strict=True)]

    def close(self, h: Any) -> None:
        h.close()

    def locate(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int, int]:
        key = self.keys(cfg, [i])[0]
        for seg in sorted((root / "segments").glob("*.seg")):
            data = seg.read_bytes()
            at = data.find(key)
            while at >= 0:
                head = at - 28
                if head >= 0 and data[head:head + 4] == b"KVTR":
                    (place,) = struct.unpack_from("<I", data, head + 8)
                    return seg, place * 512, cfg.full_page_bytes
                at = data.find(key, at + 1)
        raise LookupError(f"page {i} not found")

    def _header_at(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int]:
        key = self.keys(cfg, [i])[0]
        for seg in sorted((root / "segments").glob("*.seg")):
            data = seg.read_bytes()
            at = data.find(key)
            if at >= 28 and data[at - 28:at - 24] == b"KVTR":
                return seg, at - 28
        raise LookupError(f"page {i} not found")

    def rewrite_older_format(self, root: Path, cfg: Cfg, i: int, payload: bytes) -> None:
        import zlib

        from kvtier.store.record import payload_checksum

        seg, head = self._header_at(root, cfg, i)
        _, offset, _ = self.locate(root, cfg, i)
        old = seg.read_bytes()[head:head + 64]
        magic, _version, size, flags, length, _digest, key = struct.unpack("<4sHHIQQ32s", old[:60])
        body = struct.pack("<4sHHIQQ32s", magic, 0, size, flags, length,
                           payload_checksum(payload), key)
        patch(seg, head, body + struct.pack("<I", zlib.crc32(body)))
        patch(seg, offset, payload)

    def truncate(self, root: Path, cfg: Cfg, targets: tuple[int, ...]) -> set[int]:
        # One file holds many records: cut it in the middle of the first target's payload;
        # every record past the cut is damaged too.
        places = {i: self.locate(root, cfg, i) for i in range(PAGES)}
        seg, offset, length = places[targets[0]]
        cut = offset + length // 2
        os.truncate(seg, cut)
        return {i for i, (s, o, n) in places.items() if s == seg and o + n > cut}


class KvtierRedis(KvtierFile):
    name = "kvtier-redis"

    def __init__(self, scratch: Path, server: Any) -> None:
        super().__init__(scratch)
        self.server = server

    def open(self, root: Path, cfg: Cfg, query: str = "") -> Any:
        from kvtier.store import open_store
        from kvtier.store.guard import StoreGuard

        url = self.server.url(query=query or "timeout_s=0.5")
        return StoreGuard.open("remote", lambda: open_store(url, page_bytes=cfg.full_page_bytes),
                               page_bytes=cfg.full_page_bytes, scheme="redis", url=url)

    def rkey(self, cfg: Cfg, i: int) -> bytes:
        return b"kvtier:" + self.keys(cfg, [i])[0].hex().encode()


def tiny_checkpoint(directory: Path, weights: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                       "num_hidden_layers": LAYERS}))
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(weights.encode()).digest()[:4],
                                               "little"))
    data = rng.standard_normal(4096).astype(np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4096], "data_offsets": [0, len(data)]}})
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header))
                                                  + header.encode() + data)
