"""``file://``: the disk tier, a crash-safe page store of append-only segment files.

The package: ``store`` (``FileStore``, the page-store contract), ``segment`` (record layout and
manifest), ``record_io`` (record reads and writes), ``index`` and ``journal`` (the shared index),
``segment_files`` (open segment descriptors), ``evict`` (capacity and crash leftovers),
``options`` (URL options and the ``file://`` URL's path), ``handle`` (what ``site``, ``damage``
and ``health`` see of a store) and ``tools`` (maintenance views). Importing the package gives
``FileStore``.
"""

from kvtier.store.file.store import FileStore

__all__ = ["FileStore"]
