"""kvtier.controller: decides what moves between tiers and when; bytes move in workers.

Modules: ``controller`` (``CacheController``, what ``TieredCache`` delegates to), ``lookup``
(match across tiers and ranks), ``loadback`` (store -> host -> device before a request runs),
``prefetch`` (store -> host, prefetch policies), ``writes`` (write policies, device -> host),
``backups`` (host -> store), ``jobs`` and ``workers`` (IO jobs on worker threads), ``ranks``
(agreement across tensor-parallel ranks), ``split`` (load vs recompute), ``rates`` (what each
tier and the model's prefill deliver, learnt), ``handles`` (``Hit``, ``Loaded``), ``context``
(shared state), ``wiring`` (host pool and stores into the shared state, for building and for
live changes), ``stats``. Engine thread, except ``jobs``/``workers``.
"""
