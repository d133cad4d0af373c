"""``kvtier.model_identity``: a checkpoint's fingerprint changes with its weights, not with
where it lies, and reads a bounded number of bytes whatever the checkpoint's size."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from kvtier import model_identity
from kvtier.keys import KeyNamespace, page_keys
from kvtier.model_identity import NotACheckpoint, checkpoint_fingerprint

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "_name_or_path": "/somewhere/else", "transformers_version": "4.0"}


def _safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file, written by its published layout (u64 header length, JSON, data)."""
    header, data, offset = {}, b"", 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _checkpoint(directory: Path, seed: int, config: dict[str, object] = CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    for shard in range(2):
        _safetensors(directory / f"model-0000{shard + 1}-of-00002.safetensors",
                     {f"layers.{shard}.q": rng.standard_normal((64, 64)),
                      f"layers.{shard}.k": rng.standard_normal((64, 32)),
                      f"layers.{shard}.norm": rng.standard_normal(64)})
    return directory


def _keys(fingerprint: str) -> set[bytes]:
    namespace = KeyNamespace("llama", fingerprint, "bfloat16", "L2xH2xD32", 16)
    return set(page_keys(list(range(64)), 16, namespace))


def test_a_fine_tune_in_the_same_directory_never_shares_pages(tmp_path: Path) -> None:
    base = checkpoint_fingerprint(_checkpoint(tmp_path / "m", seed=0))
    tuned = checkpoint_fingerprint(_checkpoint(tmp_path / "m", seed=1))  # written over it
    assert base != tuned
    assert not _keys(base) & _keys(tuned)


def test_a_copy_elsewhere_is_the_same_checkpoint(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "a", seed=0)
    shutil.copytree(source, tmp_path / "b" / "copy")
    config = json.loads((tmp_path / "b" / "copy" / "config.json").read_text())
    config["_name_or_path"] = str(tmp_path / "b")  # saved again from elsewhere
    (tmp_path / "b" / "copy" / "config.json").write_text(json.dumps(config, indent=1))
    assert checkpoint_fingerprint(source) == checkpoint_fingerprint(tmp_path / "b" / "copy")
    assert _keys(checkpoint_fingerprint(source)) == _keys(
        checkpoint_fingerprint(tmp_path / "b" / "copy"))


def test_one_changed_tensor_or_config_field_changes_it(tmp_path: Path) -> None:
    base = checkpoint_fingerprint(_checkpoint(tmp_path / "m", seed=0))
    shard = tmp_path / "m" / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    start = 8 + length + header["layers.1.norm"]["data_offsets"][0]
    data[start:start + 4] = struct.pack("<f", 123.0)  # the smallest tensor's first element
    shard.write_bytes(bytes(data))
    assert checkpoint_fingerprint(tmp_path / "m") != base
    _checkpoint(tmp_path / "n", seed=0, config={**CONFIG, "rope_theta": 1e6})
    assert checkpoint_fingerprint(tmp_path / "n") != base


def test_the_cost_does_not_grow_with_the_weights(tmp_path: Path, monkeypatch:
                                                 pytest.MonkeyPatch) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(CONFIG))
    for shard in range(3):
        with open(big / f"pytorch_model-{shard}.bin", "wb") as handle:
            handle.truncate(8 << 30)  # 8 GiB each, sparse
    read = []
    real = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        read.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(model_identity.os, "pread", counting)
    first = checkpoint_fingerprint(big)
    assert sum(read) <= 3 * model_identity.SAMPLES_PER_FILE * model_identity.SAMPLE_BYTES
    with open(big / "pytorch_model-1.bin", "r+b") as handle:  # a third of the way in
        handle.seek(((8 << 30) - model_identity.SAMPLE_BYTES) // 3)
        handle.write(b"\1" * 8192)
    assert checkpoint_fingerprint(big) != first


def test_a_directory_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpoint, match="no config.json"):
        checkpoint_fingerprint(tmp_path)
