"""The ``memory://`` reference store passes the shared store contract (tests/store_contract.py).

Each test opens a named memory store unique to its temporary directory, so ``reopen`` (a second
handle on the same name) sees the same pages, like a persistent backend would.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvtier.store import open_store
from kvtier.store.base import PageStore
from kvtier.store.memory import MemoryStore
from store_contract import StoreContract


class TestMemoryStore(StoreContract):
    persistent = True

    def make_store(self, tmp_path: Path, page_bytes: int) -> PageStore:
        name = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:16]
        store = open_store(f"memory://contract-{name}", page_bytes=page_bytes)
        assert isinstance(store, MemoryStore)
        store.clear()
        return store

    def reopen(self, store: PageStore) -> PageStore:
        assert isinstance(store, MemoryStore)
        store.close()
        return open_store(f"memory://{store.name}", page_bytes=store.page_bytes)
