"""Generation-stamped bindings: which host pool and which stores every reader uses, kept in step.

Owns ``BindingTable``. A *slot* (``host_pool``, ``device_pool``, ``store.disk``,
``store.remote``) is bound to one resource at a time; every bind stamps a new generation. A
*reader* is a component that holds the resource itself (the controller's context, the copy
engine, the IO workers, the index's host allocator, the engine), registered with a function
that returns what it holds right now. ``check()`` compares each reader with its slot by
identity and names every reader left behind with the generation it still holds.

``swap(slot, new, steps, disable)`` is how a live server changes a slot: each step rebinds one
reader; then the slot is bound and checked. If a step raises or the check finds a reader left
behind, ``disable`` unbinds every reader of the slot, the slot is marked disabled (logged and
counted) and ``SwapFailed`` is raised: a tier is never left half-bound. ``check_host_shape``
refuses a host pool whose layout does not match the device pool's, with the reason.

Engine thread only (swaps and checks run between engine steps); ``stats`` from any thread.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError, LayoutMismatch

if TYPE_CHECKING:
    from kvtier.memory.device_pool import DevicePool
    from kvtier.memory.host_pool import HostPool

log = logging.getLogger("kvtier.bindings")

#: What a reader's ``holds`` returns when it does not use the slot at all (not compared).
ABSENT = object()
HISTORY = 8


class BindingIncoherent(KvtierError, RuntimeError):
    """Some reader holds another generation of a slot than the slot itself."""

    def __init__(self, lags: Sequence[Lag]) -> None:
        self.lags = list(lags)
        super().__init__("readers left behind: " + "; ".join(str(lag) for lag in self.lags))


class SwapFailed(KvtierError, RuntimeError):
    """A swap failed part-way; its slot is now disabled (the message says why)."""


@dataclass(frozen=True)
class Binding:
    """Slot ``slot`` at ``generation``: ``resource`` (None: unbound), ``facets`` (parts of the
    resource some readers hold instead, e.g. a pool's allocator), and why it is disabled."""

    slot: str
    generation: int
    resource: object = None
    facets: dict[str, object] = field(default_factory=dict)
    detail: str = ""
    disabled: str = ""

    def expected(self, facet: str | None) -> object:
        if self.resource is None:
            return None
        return self.resource if facet is None else self.facets.get(facet)


@dataclass(frozen=True)
class Later:
    """A swap target known only once the steps ran (a pool that one of them builds):
    ``resolve()`` returns the resource and its facets."""

    resolve: Callable[[], tuple[object, dict[str, object]]]


@dataclass(frozen=True)
class Reader:
    """A component holding a slot's resource (or its ``facet``), as ``holds()`` says now."""

    name: str
    slot: str
    holds: Callable[[], object]
    facet: str | None = None


@dataclass(frozen=True)
class Lag:
    """A reader holding something else than its slot's current binding."""

    reader: str
    slot: str
    held_generation: int | None      # None: an object no binding of this slot ever had
    current_generation: int

    def __str__(self) -> str:
        held = "an unknown object" if self.held_generation is None else \
            f"generation {self.held_generation}"
        return (f"{self.reader} holds {self.slot} {held}, the slot is at generation "
                f"{self.current_generation}")


class BindingTable:
    """Slots, their generations, their readers; see the module docstring."""

    def __init__(self) -> None:
        self._current: dict[str, Binding] = {}
        self._history: dict[str, deque[Binding]] = {}
        self._readers: list[Reader] = []
        self._counts: dict[str, dict[str, int]] = {}
        self.incoherent_total = 0

    # ---- binding -------------------------------------------------------------------------
    def bind(self, slot: str, resource: object, *, facets: dict[str, object] | None = None,
             detail: str = "", disabled: str = "") -> Binding:
        """Stamp ``slot`` with the next generation, bound to ``resource``."""
        previous = self._current.get(slot)
        binding = Binding(slot, previous.generation + 1 if previous else 1, resource,
                          dict(facets or {}), detail, disabled)
        self._current[slot] = binding
        self._history.setdefault(slot, deque(maxlen=HISTORY)).append(binding)
        self._counts.setdefault(slot, {"swaps": 0, "failures": 0})
        return binding

    def current(self, slot: str) -> Binding:
        binding = self._current.get(slot)
        if binding is None:
            raise KeyError(f"no slot {slot!r}; slots: {', '.join(sorted(self._current))}")
        return binding

    def register(self, reader: Reader) -> None:
        self.current(reader.slot)  # the slot must exist
        self._readers.append(reader)

    def readers(self, slot: str | None = None) -> list[Reader]:
        return [r for r in self._readers if slot is None or r.slot == slot]

    # ---- coherence -----------------------------------------------------------------------
    def check(self, slot: str | None = None) -> list[Lag]:
        """Readers (of ``slot``, or all) holding something else than the current binding."""
        lags = []
        for reader in self.readers(slot):
            held = reader.holds()
            binding = self._current[reader.slot]
            if held is ABSENT or held is binding.expected(reader.facet):
                continue
            lags.append(Lag(reader.name, reader.slot, self._generation_of(reader, held),
                            binding.generation))
        if lags:
            self.incoherent_total += 1
        return lags

    def assert_coherent(self, slot: str | None = None) -> None:
        lags = self.check(slot)
        if lags:
            raise BindingIncoherent(lags)

    def _generation_of(self, reader: Reader, held: object) -> int | None:
        for binding in reversed(self._history.get(reader.slot, ())):
            if held is binding.expected(reader.facet):
                return binding.generation
        return None

    # ---- swapping ------------------------------------------------------------------------
    def swap(self, slot: str, new: object, steps: Sequence[Callable[[], object]],
             disable: Callable[[], None], *, facets: dict[str, object] | None = None,
             detail: str = "") -> Binding:
        """Run ``steps`` (each rebinds readers to ``new``, or builds it when ``new`` is a
        ``Later``), bind, check; on any failure run ``disable`` and mark the slot disabled,
        then raise ``SwapFailed``."""
        try:
            for step in steps:
                step()
            if isinstance(new, Later):
                new, facets = new.resolve()
            binding = self.bind(slot, new, facets=facets, detail=detail)
            self.assert_coherent(slot)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._disable(slot, disable, reason)
            raise SwapFailed(f"{slot}: the swap failed part-way and the slot is disabled "
                             f"({reason})") from exc
        self._counts[slot]["swaps"] += 1
        log.info("%s bound at generation %d (%s)", slot, binding.generation, detail or "none")
        return binding

    def _disable(self, slot: str, disable: Callable[[], None], reason: str) -> None:
        try:
            disable()
        except Exception:
            log.exception("%s: disabling after a failed swap failed too", slot)
        self.bind(slot, None, detail="disabled", disabled=reason)
        self._counts[slot]["failures"] += 1
        log.error("%s disabled after a failed swap: %s", slot, reason)
        lags = self.check(slot)
        if lags:
            log.error("%s still has readers left behind: %s", slot, "; ".join(map(str, lags)))

    def stats(self) -> dict[str, object]:
        slots = {}
        for slot, binding in sorted(self._current.items()):
            slots[slot] = {"generation": binding.generation, "bound": binding.resource is not None,
                           "detail": binding.detail, "disabled": binding.disabled,
                           **self._counts.get(slot, {"swaps": 0, "failures": 0})}
        return {"slots": slots, "readers": len(self._readers),
                "incoherent_total": self.incoherent_total}


def check_host_shape(host_pool: HostPool, device_pool: DevicePool) -> None:
    """Raise ``LayoutMismatch`` naming every difference between a host pool's page layout and
    the device pool's (the copy engine moves whole parts between them)."""
    host, device = host_pool.layout, device_pool.layout
    if host == device:
        return
    names = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "mla")
    diffs = [f"{n} {getattr(host, n, None)!r} != {getattr(device, n, None)!r}" for n in names
             if getattr(host, n, None) != getattr(device, n, None)]
    raise LayoutMismatch("the host pool does not match the device layout: "
                         + (", ".join(diffs) or f"{host.fingerprint()} != {device.fingerprint()}"))
