"""Agreement across ranks that serve one model (tensor parallel): the minimum of a page count.

Owns the collectives ``TieredCache`` uses and the rule that keeps them from hanging. Each rank
holds its own cache (its own share of every page); a hit is usable only as far as every rank
has it, so the hit length used is the minimum across ranks, taken with an engine-supplied
``min_across_ranks(int) -> int``.

The rule (rank disagreement is what hangs multi-rank caches): **every rank makes the same
collective calls, in the same order, whatever its local state.** ``TieredCache`` guarantees it
for its own calls:

- ``match`` makes exactly ``MATCH_CALLS`` calls (device, host, disk and remote reach, in that
  order), ``load`` exactly ``LOAD_CALLS`` (pages available after the prefetch, pages on device
  after the load-back), ``plan_split`` exactly ``SPLIT_CALLS`` (the split: each rank measures
  its own rates); no other method makes any;
- the calls sit on straight-line code paths: an empty hit, a disabled tier, a prefetch that
  timed out, a store that raised, a full pool — each only changes the *value* a rank
  contributes (down to 0), never whether or when it calls (``RankAgreement.agree`` turns a local
  failure into a contribution of 0 before the call);
- so the engine must call ``match`` and ``load`` for the same requests in the same order on
  every rank — in particular ``load`` even when the local hit is empty — and ``plan_split``
  either on every rank or on none, and base its decisions on the agreed values (``Hit.tokens``,
  ``Hit.tokens_by_tier``, ``plan_split``'s answer, ``Loaded.tokens``), which are identical on
  every rank. (Page ids, and ``Loaded.start_tokens``, stay per rank.)

Also here: ``ThreadCollective`` (ranks as threads of one process, a barrier with a timeout, so a
missing rank raises instead of hanging; used by tests and single-host simulations) and
``torch_min_across_ranks`` (``torch.distributed`` all-reduce MIN, for real process groups).
Engine thread of each rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

Collective = Callable[[int], int]

MATCH_CALLS = 4
LOAD_CALLS = 2
SPLIT_CALLS = 1


class RankDisagreement(KvtierError, RuntimeError):
    """A collective did not complete (a rank is missing, or called in another order)."""


class RankAgreement:
    """Wraps the engine's collective: counts calls, and 0 for a rank with no collective."""

    def __init__(self, collective: Collective | None) -> None:
        self._collective = collective
        self.calls = 0

    @property
    def distributed(self) -> bool:
        return self._collective is not None

    def agree(self, local: int | Callable[[], int]) -> int:
        """The minimum of ``local`` across ranks. A callable is evaluated first; if it raises,
        this rank contributes 0 (and still calls the collective), then the error is dropped:
        a local failure must not make this rank skip a call the others are making."""
        try:
            value = int(local() if callable(local) else local)
        except Exception:
            value = 0
        value = max(value, 0)
        self.calls += 1
        if self._collective is None:
            return value
        return int(self._collective(value))


class ThreadCollective:
    """A min-reduction among ``world`` threads (one per rank); ``for_rank(r)`` is rank r's
    ``min_across_ranks``. A call that is not matched by every rank within ``timeout_s`` raises
    ``RankDisagreement`` on every rank instead of hanging."""

    def __init__(self, world: int, timeout_s: float = 10.0) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = world
        self._values = [0] * world
        self._result = 0
        self._timeout = timeout_s
        self._barrier = threading.Barrier(world, action=self._reduce)
        self.rounds = 0

    def _reduce(self) -> None:
        self._result = min(self._values)
        self.rounds += 1

    def for_rank(self, rank: int) -> Collective:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")

        def min_across_ranks(value: int) -> int:
            self._values[rank] = value
            try:
                self._barrier.wait(self._timeout)
                result = self._result
                self._barrier.wait(self._timeout)  # nobody overwrites values before all read
            except threading.BrokenBarrierError:
                raise RankDisagreement(f"rank {rank}: a collective call was not matched by all "
                                       f"{self.world} ranks within {self._timeout} s") from None
            return result

        return min_across_ranks

    def abort(self) -> None:
        self._barrier.abort()


def torch_min_across_ranks(group: ProcessGroup | None = None,
                           device: torch.device | str | None = None) -> Collective:
    """``min_across_ranks`` over a ``torch.distributed`` process group (all-reduce MIN)."""
    import torch
    import torch.distributed as dist

    def min_across_ranks(value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
        return int(tensor.item())

    return min_across_ranks
