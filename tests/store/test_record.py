"""Record headers: intact records verify; torn, foreign and corrupt ones are told apart."""

from __future__ import annotations

import os

from kvtier.store.record import HEADER_BYTES, Verdict, decode_header, encode_header, verify

KEY = bytes(range(32))
PAYLOAD = os.urandom(4096)


def test_round_trip_verifies():
    header = encode_header(KEY, PAYLOAD)
    assert len(header) == HEADER_BYTES
    assert verify(header, KEY, PAYLOAD) is Verdict.OK
    assert decode_header(header)[:2] == (KEY, len(PAYLOAD))


def test_flipped_payload_byte_is_corrupt():
    header = encode_header(KEY, PAYLOAD)
    bad = bytearray(PAYLOAD)
    bad[1000] ^= 1
    assert verify(header, KEY, bad) is Verdict.CORRUPT


def test_short_payload_is_corrupt():
    assert verify(encode_header(KEY, PAYLOAD), KEY, PAYLOAD[:-1]) is Verdict.CORRUPT


def test_other_key_is_foreign():
    other = bytes(32)
    assert verify(encode_header(other, PAYLOAD), KEY, PAYLOAD) is Verdict.FOREIGN


def test_every_flipped_header_byte_is_detected():
    header = encode_header(KEY, PAYLOAD)
    for i in range(HEADER_BYTES):
        bad = bytearray(header)
        bad[i] ^= 0x40
        assert verify(bad, KEY, PAYLOAD) is not Verdict.OK, i


def test_zeroed_and_short_headers_are_torn():
    assert verify(bytes(HEADER_BYTES), KEY, PAYLOAD) is Verdict.TORN
    assert verify(encode_header(KEY, PAYLOAD)[:10], KEY, PAYLOAD) is Verdict.TORN
