"""What one step asks the worker half of kvtier's vLLM connector to move (no vLLM import).

Owns ``LoadSpec`` and ``SaveSpec``, the entries of a step's ``KvtierConnectorMetadata``
(``scheduler``). They hold request ids, token ids and block ids only; the scheduler half
builds them on vLLM's scheduling thread and the worker half reads them on the model runner.
Kept apart from the scheduler so that the worker half, its copies and their tests run on plain
tensors without vLLM installed (any object with ``loads``, ``saves`` and ``preempted`` lists
serves as a step's metadata there).

When the workers run in processes of their own (``rank_worker``), a spec also names the pages
of kvtier's shared staging pool to read or fill (``pages``), since a worker cannot look up what
the scheduler staged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadSpec:
    """Copy tokens ``[start, end)`` of a request from its staged pages into ``block_ids``."""

    req_id: str
    start: int
    end: int
    block_ids: tuple[int, ...]
    #: Worker processes: the staged pages in prefix order, ``pages[0]`` holding the page that
    #: starts at token ``page_start`` (empty when the worker shares the scheduler's process).
    pages: tuple[int, ...] = ()
    page_start: int = 0


@dataclass(frozen=True)
class SaveSpec:
    """Store the full pages of ``tokens`` (a prompt prefix) from ``block_ids``."""

    req_id: str
    tokens: tuple[int, ...]
    salt: str | None
    block_ids: tuple[int, ...]
    #: Worker processes: every full page's staging page (prefix order); tokens from ``start``
    #: on are to be filled (the pages before it kvtier held already).
    pages: tuple[int, ...] = ()
    start: int = 0
