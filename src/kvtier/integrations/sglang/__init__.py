"""kvtier inside SGLang: a HiCache storage backend over kvtier's stores.

``kvtier.integrations.sglang`` is the ``module_path`` SGLang's dynamic storage backend is given;
``KvtierHiCacheStorage`` (``storage``) is loaded from it lazily, so the modules that hold no
SGLang import stay importable without SGLang. The modules: ``storage`` (the backend),
``keys`` (page keys, ranks, the MLA single writer), ``pages`` (SGLang's host pool layouts),
``mover`` (page bytes between the pool and the stores), ``options``, ``tiers``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier.integrations.sglang import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
