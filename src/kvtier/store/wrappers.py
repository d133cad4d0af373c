"""Wrapper stores for tests and diagnostics: latency, faults and counting around any ``PageStore``.

Owns ``WrapperStore`` (delegates everything to an inner store), ``LatencyStore`` (sleeps before
each call, fixed or per page, with seeded jitter), ``FaultStore`` (errors, refusals, detected and
silent corruption, exceptions, and hangs bounded by a deadline, chosen per page by ``FaultRule``)
and ``CountingStore`` (calls, pages, hits, time and peak concurrency per operation). Each is
itself a ``PageStore`` and they nest (``CountingStore(FaultStore(LatencyStore(file_store)))``).
Called from whatever threads call the inner store; every wrapper is thread-safe.

Counting convention (the same as the backends'): every read that returns False counts one miss,
and ``corrupt`` or ``errors`` also count why; every write that returns False counts one refusal,
and ``errors`` also counts it when an outage caused it. A wrapper's ``stats()`` is the inner
store's snapshot plus what the wrapper itself decided.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from kvtier.errors import StoreUnavailable
from kvtier.layout import ByteRange
from kvtier.store.base import Buffer, PageStore, StoreCounters, StoreStats, writable_view

OPS = ("read", "write", "contains", "delete")
PER_PAGE_FAULTS = ("error", "refuse", "corrupt", "garble")
CALL_FAULTS = ("hang", "raise")

R = TypeVar("R", list[bool], int)


class WrapperStore(PageStore):
    """A store that forwards every call to ``inner``; subclasses override what they change."""

    def __init__(self, inner: PageStore) -> None:
        super().__init__(inner.page_bytes)
        self.inner = inner
        self.scheme = inner.scheme

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        return self.inner.contains(keys)

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self.inner.read_into(keys, buffers)

    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self.inner.read_ranges_into(keys, ranges, buffers)

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self.inner.write(keys, buffers)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        return self.inner.delete(keys)

    def stats(self) -> StoreStats:
        return self.inner.stats()

    def close(self) -> None:
        self._closed = True
        self.inner.close()


# ---------------------------------------------------------------------------------------------
# Latency
# ---------------------------------------------------------------------------------------------


class LatencyStore(WrapperStore):
    """Sleeps before each call: ``base_s`` per call plus ``per_page_s`` per key, per operation,
    stretched by up to ``jitter`` (0.5 = up to +50%, seeded)."""

    def __init__(self, inner: PageStore, *, read_s: float = 0.0, write_s: float = 0.0,
                 contains_s: float = 0.0, delete_s: float = 0.0, per_page_s: float = 0.0,
                 jitter: float = 0.0, seed: int = 0) -> None:
        super().__init__(inner)
        self.base_s = {"read": read_s, "write": write_s, "contains": contains_s,
                       "delete": delete_s}
        self.per_page_s = per_page_s
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def _sleep(self, op: str, pages: int) -> None:
        delay = self.base_s[op] + self.per_page_s * pages
        if delay <= 0:
            return
        if self.jitter:
            with self._rng_lock:
                delay *= 1.0 + self.jitter * self._rng.random()
        time.sleep(delay)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._sleep("contains", len(keys))
        return super().contains(keys)

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._sleep("read", len(keys))
        return super().read_into(keys, buffers)

    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        self._sleep("read", len(keys))
        return super().read_ranges_into(keys, ranges, buffers)

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._sleep("write", len(keys))
        return super().write(keys, buffers)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._sleep("delete", len(keys))
        return super().delete(keys)


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultRule:
    """One kind of fault on one operation.

    ``kind`` per page: ``error`` (an outage: the page fails, counted as an error), ``refuse``
    (a write refused, as when the store is full), ``corrupt`` (a read fails verification,
    counted corrupt), ``garble`` (a read succeeds with flipped bytes: silent corruption, to test
    verification above the store). Per call: ``raise`` (``StoreUnavailable`` escapes, as from a
    backend that breaks the contract) and ``hang`` (the call blocks until ``release_hangs()`` or
    ``hang_s`` passes, then its pages fail as errors).

    A page (or a call, for per-call kinds) is hit when its key is in ``keys`` (None: any key),
    after ``skip`` matching pages have passed, with ``probability``, at most ``limit`` times.
    """

    op: str
    kind: str
    probability: float = 1.0
    keys: frozenset[bytes] | None = None
    skip: int = 0
    limit: int | None = None
    hang_s: float = 5.0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"fault op {self.op!r} is not one of {OPS}")
        if self.kind not in PER_PAGE_FAULTS + CALL_FAULTS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {PER_PAGE_FAULTS + CALL_FAULTS}")
        if self.kind in ("corrupt", "garble") and self.op != "read":
            raise ValueError(f"{self.kind!r} faults apply to reads only")
        if self.kind == "refuse" and self.op != "write":
            raise ValueError("'refuse' faults apply to writes only")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")
        if self.kind == "hang" and not 0 < self.hang_s <= 600:
            raise ValueError("a hang needs a deadline: 0 < hang_s <= 600")


class _ArmedRule:
    """A rule with its mutable firing state (guarded by the FaultStore's lock)."""

    def __init__(self, rule: FaultRule) -> None:
        self.rule = rule
        self.matched = 0
        self.fired = 0

    def fires(self, keys: Sequence[bytes], rng: random.Random) -> bool:
        """Whether the rule hits a page (one key) or a call (all its keys)."""
        rule = self.rule
        if rule.keys is not None and not any(bytes(k) in rule.keys for k in keys):
            return False
        if rule.limit is not None and self.fired >= rule.limit:
            return False
        self.matched += 1
        if self.matched <= rule.skip or rng.random() >= rule.probability:
            return False
        self.fired += 1
        return True


class FaultStore(WrapperStore):
    """Injects the faults its rules describe; pages no rule hits go to the inner store."""

    def __init__(self, inner: PageStore, rules: Sequence[FaultRule] = (), *, seed: int = 0) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules = [_ArmedRule(r) for r in rules]
        self._release = threading.Event()
        self._hanging = 0
        self.counters = StoreCounters()

    # ---- control -------------------------------------------------------------------------
    def add(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules.append(_ArmedRule(rule))

    def clear(self) -> None:
        """Drop every rule (calls already hanging stay until released or their deadline)."""
        with self._lock:
            self._rules.clear()

    def release_hangs(self) -> None:
        """Let every hanging call (now and later) return at once."""
        self._release.set()

    def hanging(self) -> int:
        """How many calls are blocked in a hang right now."""
        with self._lock:
            return self._hanging

    def fired(self) -> dict[tuple[str, str], int]:
        """How many times each (op, kind) has fired."""
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for armed in self._rules:
                k = (armed.rule.op, armed.rule.kind)
                out[k] = out.get(k, 0) + armed.fired
        return out

    # ---- decisions -----------------------------------------------------------------------
    def _page_faults(self, op: str, keys: Sequence[bytes]) -> list[str | None]:
        """The per-page fault kind of each key (None: pass through); fires call faults first."""
        with self._lock:
            call_kind = None
            for armed in self._rules:
                if armed.rule.op == op and armed.rule.kind in CALL_FAULTS and \
                        armed.fires(keys, self._rng):
                    call_kind, hang_s = armed.rule.kind, armed.rule.hang_s
                    break
            if call_kind is None:
                return [self._first_page_fault(op, k) for k in keys]
        if call_kind == "raise":
            raise StoreUnavailable(f"injected {op} failure")
        self._hang(hang_s)
        return ["error"] * len(keys)

    def _first_page_fault(self, op: str, key: bytes) -> str | None:
        for armed in self._rules:
            if armed.rule.op == op and armed.rule.kind in PER_PAGE_FAULTS and \
                    armed.fires((key,), self._rng):
                return armed.rule.kind
        return None

    def _hang(self, hang_s: float) -> None:
        with self._lock:
            self._hanging += 1
        try:
            self._release.wait(hang_s)
        finally:
            with self._lock:
                self._hanging -= 1

    # ---- the store -----------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        faults = self._page_faults("contains", keys)
        return _merge(faults, keys, self.inner.contains, False)

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        return self._read(keys, buffers, self.page_bytes, self.inner.read_into)

    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        want = sum(r.length for r in ranges)
        return self._read(keys, buffers, want,
                          lambda ks, bs: self.inner.read_ranges_into(ks, ranges, bs))

    def _read(self, keys: Sequence[bytes], buffers: Sequence[Buffer], nbytes: int,
              reader: Callable[[Sequence[bytes], Sequence[Buffer]], list[bool]]) -> list[bool]:
        views = [writable_view(b, nbytes) for b in buffers]  # misuse raises before any fault
        faults = self._page_faults("read", keys)
        passing = [i for i, f in enumerate(faults) if f in (None, "garble")]
        results = [False] * len(keys)
        for i, ok in zip(passing, reader([keys[i] for i in passing], [views[i] for i in passing]),
                         strict=True):
            results[i] = ok
            if ok and faults[i] == "garble" and nbytes:
                views[i][0] ^= 0xFF
        failed = [f for f in faults if f in ("error", "corrupt")]
        self.counters.add(misses=len(failed), corrupt=failed.count("corrupt"),
                          errors=failed.count("error"))
        return results

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check_batch(keys, buffers)
        faults = self._page_faults("write", keys)
        passing = [i for i, f in enumerate(faults) if f is None]
        results = [False] * len(keys)
        written = self.inner.write([keys[i] for i in passing], [buffers[i] for i in passing])
        for i, ok in zip(passing, written, strict=True):
            results[i] = ok
        self.counters.add(refused=len(keys) - len(passing), errors=faults.count("error"))
        return results

    def delete(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        faults = self._page_faults("delete", keys)
        return self.inner.delete([k for k, f in zip(keys, faults, strict=True) if f is None])

    def stats(self) -> StoreStats:
        inner = self.inner.stats()
        own = self.counters.snapshot()
        return replace(inner, **{name: getattr(inner, name) + own[name]
                                 for name in ("misses", "corrupt", "refused", "errors")})


def _merge(faults: list[str | None], keys: Sequence[bytes],
           call: Callable[[list[bytes]], list[bool]], failed: bool) -> list[bool]:
    passing = [i for i, f in enumerate(faults) if f is None]
    results = [failed] * len(keys)
    for i, ok in zip(passing, call([keys[i] for i in passing]), strict=True):
        results[i] = ok
    return results


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCount:
    """Totals of one operation through a ``CountingStore``."""

    calls: int = 0
    pages: int = 0
    ok: int = 0
    seconds: float = 0.0
    peak_in_flight: int = 0


class CountingStore(WrapperStore):
    """Counts calls, pages, successes, time and peak concurrency of each operation.

    With ``record=True`` it also keeps ``log``: (op, keys) of every call, in order.
    """

    def __init__(self, inner: PageStore, *, record: bool = False) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._counts = {op: OpCount() for op in OPS}
        self._in_flight = dict.fromkeys(OPS, 0)
        self.record = record
        self.log: list[tuple[str, tuple[bytes, ...]]] = []

    def counts(self) -> dict[str, OpCount]:
        with self._lock:
            return dict(self._counts)

    def _timed(self, op: str, keys: Sequence[bytes], call: Callable[[], R]) -> R:
        with self._lock:
            self._in_flight[op] += 1
            peak = max(self._counts[op].peak_in_flight, self._in_flight[op])
            self._counts[op] = replace(self._counts[op], peak_in_flight=peak)
            if self.record:
                self.log.append((op, tuple(bytes(k) for k in keys)))
        start = time.perf_counter()
        result: list[bool] | int = 0
        try:
            result = call()
            return result
        finally:
            elapsed = time.perf_counter() - start
            ok = sum(result) if isinstance(result, list) else result
            with self._lock:
                self._in_flight[op] -= 1
                c = self._counts[op]
                self._counts[op] = replace(c, calls=c.calls + 1, pages=c.pages + len(keys),
                                           ok=c.ok + ok, seconds=c.seconds + elapsed)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self._timed("contains", keys, lambda: super(CountingStore, self).contains(keys))

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        return self._timed("read", keys,
                           lambda: super(CountingStore, self).read_into(keys, buffers))

    def read_ranges_into(self, keys: Sequence[bytes], ranges: Sequence[ByteRange],
                         buffers: Sequence[Buffer]) -> list[bool]:
        return self._timed("read", keys, lambda: super(CountingStore, self).read_ranges_into(
            keys, ranges, buffers))

    def write(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        return self._timed("write", keys, lambda: super(CountingStore, self).write(keys, buffers))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._timed("delete", keys, lambda: super(CountingStore, self).delete(keys))
