"""The chaos suite's store driver interface (``chaos.py``): ``Adapter``, what each system's
driver implements (open / put / get through the system's own public API, and where a page's
payload lies on disk so a fault can reach it), and the scoring every fault shares: write the
pages, reopen the store as a restarted server would, read every page back and count it
(``score``: served wrong, refused, errors, lost).

Runs in a ``--worker`` process, on its main thread (and, for the Redis faults that read under
load, beside the thread that makes the load)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from chaos_pages import BASE, PAGES, Cfg, Count, expected, patch


class Adapter:
    """Open / put / get through a system's API; ``locate`` finds a page's payload bytes."""

    name = ""
    restart_forgets = False                # a new process starts with an empty index
    index_files: tuple[str, ...] = ()      # metadata beside the pages ("deleted_index")
    manifest_files: tuple[str, ...] = ()   # ("deleted_manifest")

    def open(self, root: Path, cfg: Cfg) -> Any:
        raise NotImplementedError

    def put(self, h: Any, cfg: Cfg, idx: list[int], pages: list[bytes]) -> list[bool]:
        raise NotImplementedError

    def get(self, h: Any, cfg: Cfg, idx: list[int]) -> list[bytes | None]:
        raise NotImplementedError

    def close(self, h: Any) -> None:
        pass

    def locate(self, root: Path, cfg: Cfg, i: int) -> tuple[Path, int, int]:
        """(file, offset, length) of page ``i``'s payload."""
        raise NotImplementedError

    def rewrite_older_format(self, root: Path, cfg: Cfg, i: int, payload: bytes) -> None:
        """Leave page ``i`` as an older version of this system would have written it."""
        path, offset, _ = self.locate(root, cfg, i)
        patch(path, offset, payload)

    def truncate(self, root: Path, cfg: Cfg, targets: tuple[int, ...]) -> set[int]:
        """Cut the records of ``targets`` short; the pages it damaged."""
        for i in targets:
            path, offset, length = self.locate(root, cfg, i)
            os.truncate(path, offset + length // 2)
        return set(targets)


def score(ad: Adapter, h: Any, cfg: Cfg, damaged: set[int], idx: list[int] | None = None,
           reusable: bool = True) -> Count:
    """Read every page; wrong if served bytes differ from ``cfg``'s page, lost if a page the
    fault did not damage is not served (``reusable``: such pages should have survived)."""
    idx = list(range(PAGES)) if idx is None else idx
    c = Count()
    try:
        got = ad.get(h, cfg, idx)
    except Exception as exc:  # counted page by page below
        c.note = f"{type(exc).__name__}: {exc}"[:160]
        got = []
        for i in idx:  # page by page, to count the rest
            try:
                got += ad.get(h, cfg, [i])
            except Exception:
                c.errors += 1
                got.append(None)
    for i, page in zip(idx, got, strict=True):
        if page is None:
            c.refused += 1
            if reusable and i not in damaged:
                c.lost += 1
        elif page != expected(cfg, i):
            c.wrong += 1
    return c


def fresh(ad: Adapter, root: Path, cfg: Cfg = BASE) -> None:
    h = ad.open(root, cfg)
    acked = ad.put(h, cfg, list(range(PAGES)), [expected(cfg, i) for i in range(PAGES)])
    assert all(acked), f"{ad.name}: initial writes refused"
    ad.close(h)


def reopen_and_score(ad: Adapter, root: Path, cfg: Cfg, damaged: set[int],
                      reusable: bool = True) -> Count:
    try:
        h = ad.open(root, cfg)
    except Exception as exc:
        return Count(errors=1, refused=PAGES, lost=PAGES - len(damaged) if reusable else 0,
                     note=f"open: {type(exc).__name__}: {exc}"[:160])
    try:
        return score(ad, h, cfg, damaged, reusable=reusable)
    finally:
        ad.close(h)
