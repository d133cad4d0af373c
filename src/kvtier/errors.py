"""The kvtier exception tree.

Owns every exception type kvtier raises on purpose. Misses and timeouts are values, not
exceptions; these classes are for misuse, capacity refusals and outages. Each class also
subclasses the fitting built-in so callers that catch ``ValueError`` or ``MemoryError`` keep
working. No imports beyond the standard library; used from every thread.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"config field {field!r}: got {value!r}; allowed: {allowed}")


class CapacityError(KvtierError, MemoryError):
    """A capacity limit refused a request before anything was allocated."""


class PinnedBudgetExceeded(CapacityError):
    """A reservation of pinned host bytes would pass the process-wide pinned budget."""

    def __init__(self, owner: str, asked: int, held: int, allowed: int) -> None:
        self.owner = owner
        self.asked = asked
        self.held = held
        self.allowed = allowed
        super().__init__(
            f"pinned budget exceeded: owner {owner!r} asked {asked} bytes, "
            f"{held} bytes already held, {allowed} bytes allowed"
        )


class PoolExhausted(CapacityError):
    """A page pool cannot hand out the number of pages asked for (nothing was allocated)."""


class StoreUnavailable(KvtierError, ConnectionError):
    """A page store cannot be opened or reached (bad URL, wrong password, unreachable server)."""


class StoreCorrupt(StoreUnavailable):
    """A store's own description of itself is damaged (a lost or garbled manifest, a garbage
    journal head), so none of its pages can be read. ``location`` (when set) is the directory
    and its ``(st_dev, st_ino)`` as found, which a fail-open opener may move aside."""

    def __init__(self, message: str, location: tuple[str, int, int] | None = None) -> None:
        super().__init__(message)
        self.location = location


class StoreClosed(KvtierError, RuntimeError):
    """An operation was attempted on a store after ``close()``."""


class PageCorrupt(KvtierError, ValueError):
    """A stored page failed verification (header, key or checksum mismatch).

    Stores report corrupt pages as counted misses; this exception is for tools such as
    ``kvtier store verify`` that want the reason.
    """


class LayoutMismatch(KvtierError, ValueError):
    """Two components disagree about the KV layout (shape, dtype or page size)."""


class TransferTimeout(KvtierError, TimeoutError):
    """A copy between tiers did not complete within its deadline."""
