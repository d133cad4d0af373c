"""Page keys: determinism across processes, namespace and salt isolation, chain behaviour."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.keys import KeyNamespace, PageKey, chain_keys, page_keys, token_bytes

NS = KeyNamespace("llama", "abc123", "bfloat16", "mha:L2:H2:D4:bfloat16:P4", 4)
TOKENS = list(range(100, 117))  # 17 tokens: 4 full pages of 4 and a partial one


def test_only_full_pages_get_keys():
    assert len(page_keys(TOKENS, 4, NS)) == 4
    assert page_keys(TOKENS[:3], 4, NS) == []


def test_keys_are_32_bytes_with_stable_hex():
    key = page_keys(TOKENS, 4, NS)[0]
    assert isinstance(key, PageKey) and len(key) == 32
    assert PageKey.from_hex(str(key)) == key


def test_pagekey_rejects_wrong_length():
    with pytest.raises(ValueError):
        PageKey(b"short")


def test_token_change_changes_that_page_and_later_keys_only():
    base = page_keys(TOKENS, 4, NS)
    changed = list(TOKENS)
    changed[9] += 1  # page 2
    after = page_keys(changed, 4, NS)
    assert after[:2] == base[:2]
    assert all(a != b for a, b in zip(after[2:], base[2:], strict=True))


@pytest.mark.parametrize("field,value", [
    ("model", "qwen"), ("model_fingerprint", "def456"), ("kv_dtype", "float16"),
    ("layout", "mha:L2:H2:D8:bfloat16:P4"), ("format_version", 2),
])
def test_any_namespace_field_gives_disjoint_keys(field, value):
    other = KeyNamespace(**{**{f: getattr(NS, f) for f in NS.__slots__}, field: value})
    assert not set(page_keys(TOKENS, 4, NS)) & set(page_keys(TOKENS, 4, other))


def test_page_size_gives_disjoint_keys():
    other = KeyNamespace(NS.model, NS.model_fingerprint, NS.kv_dtype, NS.layout, 2)
    assert not set(page_keys(TOKENS[:16], 4, NS)) & set(page_keys(TOKENS[:16], 2, other))


def test_salt_gives_disjoint_keys_and_is_deterministic():
    plain = page_keys(TOKENS, 4, NS)
    a1, a2 = page_keys(TOKENS, 4, NS, salt="tenant-a"), page_keys(TOKENS, 4, NS, salt=b"tenant-a")
    b = page_keys(TOKENS, 4, NS, salt="tenant-b")
    assert a1 == a2
    assert not set(plain) & set(a1) and not set(a1) & set(b)


def test_namespace_fields_cannot_be_shifted_into_each_other():
    a = KeyNamespace("ab", "c", "x", "y", 4)
    b = KeyNamespace("a", "bc", "x", "y", 4)
    assert a.seed() != b.seed()


def test_list_numpy_and_torch_inputs_agree():
    import torch

    expected = page_keys(TOKENS, 4, NS)
    assert page_keys(np.array(TOKENS, dtype=np.int64), 4, NS) == expected
    assert page_keys(torch.tensor(TOKENS), 4, NS) == expected


def test_chain_extends_from_last_key():
    keys = page_keys(TOKENS, 4, NS)
    tail = chain_keys(token_bytes(TOKENS[8:16]), 4, keys[1])
    assert tail == keys[2:4]


def test_page_size_must_match_namespace():
    with pytest.raises(ValueError):
        page_keys(TOKENS, 8, NS)


_CHILD = (
    "from kvtier.keys import KeyNamespace, page_keys;"
    "ns = KeyNamespace('llama', 'abc123', 'bfloat16', 'mha:L2:H2:D4:bfloat16:P4', 4);"
    "print(','.join(k.hex() for k in page_keys(list(range(100, 117)), 4, ns, salt='s')))"
)


def test_keys_identical_across_processes_with_different_hash_seeds():
    outputs = set()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        outputs.add(out)
    assert len(outputs) == 1
    assert outputs.pop() == ",".join(k.hex() for k in page_keys(TOKENS, 4, NS, salt="s"))
