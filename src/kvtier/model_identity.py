"""The identity of a model checkpoint: a short digest that changes when its weights change.

Owns ``checkpoint_fingerprint`` (a local checkpoint directory or weight file), the rule every
integration uses by default for ``KeyNamespace.model_fingerprint``, so that two checkpoints of
one architecture and one name (a fine-tune written over the base, in the same directory) never
share KV pages. Pure Python (hashlib, json, os, struct); runs once on the thread that builds a
connector or an engine, before the first page key is made.

The rule, in order (every part enters one SHA-256):

1. ``config.json``, parsed and written back with sorted keys, without the fields that name where
   or by what it was saved (``_name_or_path``, ``transformers_version``), so a copy of a
   checkpoint in another directory gets the same digest.
2. For every weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``, sorted
   by path relative to the checkpoint): its relative path and size, then
   - safetensors: the whole JSON header (every tensor's name, dtype, shape and offsets) and, for
     every tensor, ``SAMPLE_BYTES`` at its start and ``SAMPLE_BYTES`` at its middle;
   - any other format: ``SAMPLE_BYTES`` at ``SAMPLES_PER_FILE`` evenly spaced offsets (the
     first at 0, the last ending at the file's end).

What it costs does not grow with the weights' bytes: a 70B checkpoint in safetensors (about 30
shards, 700 tensors) reads about 1,400 blocks of 4 KiB plus the headers, about 6 MiB. What it
cannot see: a change confined to bytes that no sample covers (say, one element in the middle of
one tensor). Set the fingerprint by hand (every integration's ``model_fingerprint`` option) when
that matters, or to make two checkpoints share pages on purpose.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

#: Bytes read per sample: one page-cache page, read in one call (chosen as the smallest read a
#: disk serves at its random-read cost; more bytes per sample buy nothing against whole-tensor
#: changes, which fine-tunes make).
SAMPLE_BYTES = 4096
#: Samples of a weight file whose format gives no tensor boundaries.
SAMPLES_PER_FILE = 64
#: Weight files by suffix.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: ``config.json`` fields that say where or with what a checkpoint was saved, not what it is.
UNSTABLE_CONFIG_FIELDS = ("_name_or_path", "transformers_version")
#: A safetensors header larger than this is not read whole (it is not a real header).
MAX_SAFETENSORS_HEADER = 100 << 20


class NotACheckpoint(ValueError):
    """The path holds neither a ``config.json`` nor a weight file."""


def checkpoint_fingerprint(path: str | os.PathLike[str]) -> str:
    """32 hex digits naming the checkpoint at ``path`` (a directory, or one weight file) by the
    rule in this module's docstring. Raises ``NotACheckpoint`` when nothing there is one, and
    ``OSError`` when a file cannot be read."""
    root = Path(path)
    digest = hashlib.sha256(b"kvtier-checkpoint-v1\0")
    if root.is_file():
        files = [root]
        base = root.parent
    else:
        base = root
        config = root / "config.json"
        if config.is_file():
            digest.update(b"config\0" + _stable_config(config.read_bytes()))
        files = sorted(p for p in root.rglob("*")
                       if p.suffix in WEIGHT_SUFFIXES and p.is_file())
        if not files and not config.is_file():
            raise NotACheckpoint(f"{root} holds no config.json and no weight file "
                                 f"({', '.join(WEIGHT_SUFFIXES)})")
    for file in files:
        _digest_weight_file(digest, file, file.relative_to(base).as_posix())
    return digest.hexdigest()[:32]


def _stable_config(data: bytes) -> bytes:
    try:
        body = json.loads(data)
    except ValueError:
        return data  # not JSON: its bytes are its identity
    if isinstance(body, dict):
        for name in UNSTABLE_CONFIG_FIELDS:
            body.pop(name, None)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _digest_weight_file(digest: hashlib._Hash, file: Path, name: str) -> None:
    size = file.stat().st_size
    digest.update(b"file\0" + name.encode() + b"\0" + str(size).encode() + b"\0")
    with open(file, "rb") as handle:
        fd = handle.fileno()
        offsets = _safetensors_samples(fd, size, digest) if file.suffix == ".safetensors" else None
        if offsets is None:
            offsets = _even_samples(size)
        for offset in offsets:
            digest.update(os.pread(fd, SAMPLE_BYTES, offset))


def _even_samples(size: int) -> list[int]:
    last = max(0, size - SAMPLE_BYTES)
    if SAMPLES_PER_FILE < 2 or last == 0:
        return [0]
    return sorted({last * i // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)})


def _safetensors_samples(fd: int, size: int, digest: hashlib._Hash) -> list[int] | None:
    """Digest a safetensors header; the sample offsets of its tensors (None: not one)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    (length,) = struct.unpack("<Q", head)
    if length > MAX_SAFETENSORS_HEADER or 8 + length > size:
        return None
    header = os.pread(fd, length, 8)
    try:
        tensors = json.loads(header)
    except ValueError:
        return None
    if not isinstance(tensors, dict):
        return None
    digest.update(b"header\0" + header)
    offsets = []
    for name in sorted(tensors):
        entry = tensors[name]
        span = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(span, list) and len(span) == 2):
            continue
        start, end = 8 + length + int(span[0]), 8 + length + int(span[1])
        offsets.append(start)
        middle = (start + end) // 2
        if middle + SAMPLE_BYTES <= end and middle > start:
            offsets.append(middle)
    return offsets
