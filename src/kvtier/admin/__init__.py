"""kvtier.admin: live reconfiguration of a running cache, between the facade and the server.

Modules: ``reconfig`` (``StorageAdmin``: attach, detach, clear, resize stores, flush tiers),
``host_rebuild`` (a new host pool under a live cache), ``bindings`` (generation-stamped slots and
the readers that hold them, checked after every change), ``reconfig_support`` (refusal errors,
opening a store for one tier, URL redaction, store health). Pools and stores are wired in through
``kvtier.controller.wiring``, the same functions ``TieredCache.build`` uses. Engine thread, with
the engine idle, except ``StorageAdmin.resize`` and the health snapshot.
"""
