"""kvtier inside vLLM: the KV connector, the offloading tier and policy plug-ins, and what they share.

``kvtier.integrations.vllm`` is the module path vLLM is given (``kv_connector_module_path``);
``KvtierConnector`` is loaded from it lazily, so the modules of this package that hold no vLLM
import (``specs``, ``layout``, ``blocks``) stay importable, and testable, without vLLM. The
modules, by role:

- ``connector``: ``KvtierConnector``, vLLM's ``KVConnectorBase_V1``; ``compat``: every
  difference between the vLLM versions kvtier supports, and the refusal outside them;
- scheduler half: ``scheduler``, ``events``, ``rank_steps``; worker half: ``worker``,
  ``rank_worker``, ``saves``, ``saver``, ``blocks``, ``layout``, ``specs``;
- shared: ``runtime`` (the one ``TieredCache`` of an engine), ``options``, ``shared_pool``;
- vLLM's native offloading plug-ins: ``tiers`` (a secondary tier), ``policy`` (eviction).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvtierConnector", "KvtierConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
