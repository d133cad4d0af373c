"""``redis://`` and ``rediss://``: the remote page store on Redis or Valkey.

The package: ``store`` (``RedisStore``, the page-store contract), ``options`` (URL split and
settings), ``nodes`` (one server or a cluster's primaries), ``endpoint`` (connections, breaker
and its prober), ``breaker``, ``ops`` (units of wire work), ``wire`` / ``pages`` / ``channel``
(RESP bytes, page replies, the deadline-bound socket) and ``verify`` (judging replies). redis-py
is imported only when a store opens. Importing the package gives ``RedisStore``.
"""

from kvtier.store.redis.store import RedisStore

__all__ = ["RedisStore"]
