"""Progress bars for long replays: a tqdm bar on stderr, or a silent stand-in.

Owns ``progress_bar(total, label, enabled)``, used by the replay study and by ``kvtier bench
replay``. Main thread.
"""

from __future__ import annotations

import sys
from typing import Any


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def progress_bar(total: int, label: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (a silent stand-in when disabled or tqdm is not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=label, unit="req", leave=False, disable=not enabled,
                file=sys.stderr, mininterval=0.5)
