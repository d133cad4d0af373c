"""Options of the ``file://`` store, parsed from URL query parameters or keyword arguments.

Owns ``FileStoreOptions`` (frozen) and its parser, which names the option, the value and what is
allowed on any mistake, and ``file_url_path``, the one reading of a ``file://`` URL's directory
that every command and the store share. Called on the thread that opens the store.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, SupportsIndex, SupportsInt
from urllib.parse import unquote, urlsplit

from kvtier.errors import ConfigError
from kvtier.units import parse_size

_TRUE = ("1", "true", "yes", "on")
_URL_FORM = "file:///absolute/path (a local directory)"


def file_url_path(url: str) -> Path:
    """The directory a ``file://`` URL names; ConfigError for another host (``file://a/b``
    names host ``a``, not the relative path ``a/b``), a relative or an empty path."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        raise ConfigError("store url", url, _URL_FORM)
    if parts.netloc not in ("", "localhost"):
        raise ConfigError("store url", url, f"{_URL_FORM}; this URL names host "
                          f"{parts.netloc!r} (for a relative path, give its absolute form: "
                          f"file://{Path(parts.netloc + parts.path).absolute()})")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ConfigError("store url", url, f"{_URL_FORM}; {path!r} is not absolute")
    return Path(path)

_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class FileStoreOptions:
    """How a file store behaves; ``segment_bytes`` only matters when the store is created."""

    max_bytes: int | None = None       # cap on segment bytes (None: none)
    min_free_bytes: int = 0            # keep this much free on the filesystem
    segment_bytes: int = 256 << 20     # size of one segment file
    verify: str = "full"               # "full": payload checksum on every read; "header"
    direct: bool = False               # O_DIRECT reads and writes (through aligned buffers)
    fsync: bool = False                # fdatasync records and journal before acknowledging
    max_open_files: int = 256          # read descriptors kept open per store handle

    @classmethod
    def parse(cls, options: dict[str, object]) -> FileStoreOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError("file store options", unknown, ", ".join(sorted(known)))
        values: dict[str, Any] = {}
        for name, raw in options.items():
            values[name] = _parse_one(name, raw)
        return cls(**values)


def _parse_one(name: str, raw: object) -> object:
    if name in ("max_bytes", "min_free_bytes", "segment_bytes"):
        if raw is None and name == "max_bytes":
            return None
        value = raw if isinstance(raw, int) and not isinstance(raw, bool) else parse_size(str(raw))
        if value is None or value < 0 or (name != "min_free_bytes" and value == 0):
            raise ConfigError(name, raw, "a byte count such as 64GiB")
        return value
    if name in ("direct", "fsync"):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text not in _TRUE + _FALSE:
            raise ConfigError(name, raw, "true or false")
        return text in _TRUE
    if name == "verify":
        if raw not in ("full", "header"):
            raise ConfigError(name, raw, "full or header")
        return raw
    try:
        if not isinstance(raw, (str, bytes, SupportsInt, SupportsIndex)):
            raise TypeError(type(raw).__name__)
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value < 8:
        raise ConfigError(name, raw, "an integer >= 8")
    return value
