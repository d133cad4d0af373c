"""The reference memory store and open_store's URL handling (full contract: tests/store_contract.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import ConfigError, StoreClosed
from kvtier.store import open_store

PAGE = 256


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_named_memory_store_is_shared_between_handles():
    a = open_store("memory://shared-test", page_bytes=PAGE)
    b = open_store("memory://shared-test", page_bytes=PAGE)
    a.write([_key(1)], [np.full(PAGE, 7, np.uint8)])
    out = np.zeros(PAGE, np.uint8)
    assert b.read_into([_key(1)], [out]) == [True] and out[0] == 7


def test_cap_evicts_oldest_and_counts():
    store = open_store("memory://?max_bytes=1KiB", page_bytes=PAGE)
    for i in range(6):
        store.write([_key(i)], [bytes(PAGE)])
    assert store.contains([_key(0), _key(1), _key(5)]) == [False, False, True]
    assert store.stats().evicted == 2 and store.stats().pages == 4


def test_unknown_scheme_and_option_are_config_errors():
    with pytest.raises(ConfigError, match="scheme"):
        open_store("ftp://x", page_bytes=PAGE)
    with pytest.raises(ConfigError):
        open_store("memory://?colour=red", page_bytes=PAGE)


@pytest.mark.parametrize("max_bytes", [1.5, [1024], "lots"])
def test_a_memory_store_cap_that_is_no_byte_count_is_refused_naming_it(max_bytes: object) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        open_store("memory://", page_bytes=PAGE, max_bytes=max_bytes)


def test_closed_store_raises_and_wrong_buffer_size_raises():
    store = open_store("memory://", page_bytes=PAGE)
    with pytest.raises(ValueError):
        store.write([_key(1)], [bytes(PAGE - 1)])
    store.close()
    with pytest.raises(StoreClosed):
        store.contains([_key(1)])


def test_torch_tensor_buffers_and_ranges():
    import torch

    store = open_store("memory://", page_bytes=PAGE)
    src = torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)
    store.write([_key(3)], [src])
    from kvtier.layout import ByteRange

    out = torch.zeros(20, dtype=torch.uint8)
    assert store.read_ranges_into([_key(3)], [ByteRange(10, 10), ByteRange(100, 10)], [out]) == [True]
    assert out.tolist() == list(range(10, 20)) + list(range(100, 110))
