"""The ``file://`` store passes the shared store contract, persistently (tests/store_contract.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.store import open_store
from kvtier.store.base import PageStore
from kvtier.store.file import FileStore
from store_contract import StoreContract


class TestFileStore(StoreContract):
    persistent = True

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        return open_store(f"file://{tmp_path}/store", page_bytes=page_bytes)

    def reopen(self, store: PageStore) -> PageStore:
        assert isinstance(store, FileStore)
        store.close()
        return open_store(f"file://{store.root}", page_bytes=store.page_bytes)


class TestFileStoreLargePages(TestFileStore):
    """Pages of several 64 KiB chunks: records carry a chunk table, partial reads use it."""

    page_bytes = 3 * 65536 + 4099
    machine_examples = 8


class TestFileStoreDirect(TestFileStore):
    """O_DIRECT reads and writes through aligned bounce buffers."""

    machine_examples = 8

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        try:
            return open_store(f"file://{tmp_path}/store?direct=true", page_bytes=page_bytes)
        except ConfigError as exc:
            pytest.skip(f"no O_DIRECT here: {exc}")

    def reopen(self, store: PageStore) -> PageStore:
        assert isinstance(store, FileStore)
        store.close()
        return open_store(f"file://{store.root}?direct=true", page_bytes=store.page_bytes)
