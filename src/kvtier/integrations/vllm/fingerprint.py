"""The vLLM connector's default ``model_fingerprint``: derived from the weights vLLM loads.

Owns ``model_fingerprint(vllm_config, given)``. Runs once, on the thread that builds the
connector (scheduler and workers each compute it; it is deterministic, so they agree). No torch;
vLLM's config is read by attribute only.

The rule (the connector's ``model_fingerprint`` option overrides all of it):

- weights loaded as ``dummy`` (random weights from vLLM's fixed seed): a digest of the
  architecture's config and the dtype, the only things those weights depend on;
- a local checkpoint (``model`` is a directory or file): ``kvtier.model_identity
  .checkpoint_fingerprint`` (``config.json`` content, each weight file's name, size, safetensors
  header and sampled blocks): a fine-tune written into the same directory changes it, a copy of
  the checkpoint elsewhere does not;
- a Hugging Face hub id: the same rule over the snapshot vLLM downloaded (its directory is named
  by the commit), found in the local hub cache;
- anything else (a checkpoint not on this machine's disk, a loader kvtier cannot see through):
  the config and the requested revision, with a warning that pages are shared by name; set
  ``model_fingerprint`` there.

Every result is prefixed by what it came from (``ckpt:``, ``dummy:``, ``config:``), so the
fingerprint in a store's keys says which rule named it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from kvtier.model_identity import NotACheckpoint, checkpoint_fingerprint

log = logging.getLogger("kvtier.vllm")


def model_fingerprint(vllm_config: Any, given: str) -> str:
    """``given`` when set, else the fingerprint the module docstring's rule derives."""
    if given:
        return given
    model_config = vllm_config.model_config
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    config_text = model_config.hf_config.to_json_string()
    if load_format == "dummy":
        return "dummy:" + _digest(config_text, str(getattr(model_config, "dtype", "")))
    local = _local_checkpoint(vllm_config)
    if local is not None:
        try:
            return "ckpt:" + checkpoint_fingerprint(local)
        except (NotACheckpoint, OSError) as exc:
            log.warning("kvtier: cannot read the checkpoint at %s to fingerprint it (%s)",
                        local, exc)
    log.warning("kvtier: the weights of %r are not on this machine's disk where kvtier can "
                "read them; pages are keyed by its config and revision only. Set "
                "kv_connector_extra_config.model_fingerprint if another checkpoint of this "
                "name may write to the same stores", str(model_config.model))
    return "config:" + _digest(config_text, str(getattr(model_config, "revision", None)))


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:32]


def _local_checkpoint(vllm_config: Any) -> Path | None:
    """The directory (or file) the weights are read from, when it is on this machine."""
    model_config = vllm_config.model_config
    path = Path(str(model_config.model)).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    load_config = getattr(vllm_config, "load_config", None)
    try:
        snapshot = snapshot_download(str(model_config.model),
                                     revision=getattr(model_config, "revision", None),
                                     cache_dir=getattr(load_config, "download_dir", None),
                                     local_files_only=True)
    except Exception:  # not in the local cache, not a hub id: the fallback says so
        return None
    return Path(snapshot)
