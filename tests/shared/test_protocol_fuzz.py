"""Hostile input: random bytes, truncations, bit flips, wrong types, oversize declarations, decompression
bombs and NaN/Inf tensors all end in ProtocolError (with a known code), never another exception or a hang."""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import messages

from shared import codecs as C
from shared import protocol as P

CODES = set(P.PROTOCOL_ERROR_CODES)


def decode_or_refuse(data: bytes, limits: P.Limits | None = None):
    try:
        return P.decode_message(data, limits)
    except P.ProtocolError as e:
        assert e.code in CODES, e.code
        return None


# Each property runs twice: a few hundred examples in the default suite, and the full count slow-marked
# (``-m slow``), from one body. ``_two_sizes(n_default, n_slow, strategies, settings)`` -> (default, slow).
def _two_sizes(n_default: int, n_slow: int, *strategies, **kw):
    def wrap(body):
        default = settings(max_examples=n_default, deadline=None, **kw)(given(*strategies)(body))
        slow = settings(max_examples=n_slow, deadline=None, **kw)(given(*strategies)(body))
        return default, pytest.mark.slow(slow)
    return wrap


def _random_bytes(data):
    decode_or_refuse(data)


test_random_bytes, test_random_bytes_many = _two_sizes(300, 2000, st.binary(max_size=256))(_random_bytes)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.data())
def test_truncated_frames_are_refused(msg, data):
    frame = P.encode_message(msg)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(frame[:cut])
    assert e.value.code in CODES


def _corrupted_frames_decode_or_refuse(msg, data):
    frame = bytearray(P.encode_message(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    out = decode_or_refuse(bytes(frame))
    if out is not None:  # still a valid message: its re-encoding decodes to itself
        assert P.decode_message(P.encode_message(out)) == out


test_corrupted_frames_decode_or_refuse, test_corrupted_frames_decode_or_refuse_many = _two_sizes(
    200, 800, messages, st.data(), suppress_health_check=[HealthCheck.too_slow])(_corrupted_frames_decode_or_refuse)


# any msgpack value in place of a field
wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4), max_leaves=12)


def _wrong_types_in_any_field(msg, data):
    value = msgpack.unpackb(P.encode_message(msg))
    i = data.draw(st.integers(1, len(value) - 1)) if len(value) > 1 else 0
    value[i] = data.draw(wire_values)
    decode_or_refuse(msgpack.packb(value, use_bin_type=True))


test_wrong_types_in_any_field, test_wrong_types_in_any_field_many = _two_sizes(
    250, 1000, messages, st.data(), suppress_health_check=[HealthCheck.too_slow])(_wrong_types_in_any_field)


def _random_field_arrays(type_code, fields):
    decode_or_refuse(msgpack.packb([type_code, *fields], use_bin_type=True))


test_random_field_arrays, test_random_field_arrays_many = _two_sizes(
    100, 300, st.sampled_from(sorted(P.MESSAGE_TYPES)), st.lists(wire_values, max_size=12))(_random_field_arrays)


@pytest.mark.parametrize("frame, code", [
    (b"", "bad_frame"),
    (b"\xc6\xff\xff\xff\xff" + b"x" * 10, None),  # bin declaring 4 GiB
    (b"\xdd\xff\xff\xff\xff", "too_large"),  # array declaring 4 Gi elements
    (b"\xdb\xff\xff\xff\xff", None),  # str declaring 4 GiB
    (b"\xdf\x00\x00\x00\x01\xa1a\x01", "bad_type"),  # a map
    (b"\x91" * 100_000, "bad_frame"),  # nesting bomb
    (msgpack.packb(msgpack.ExtType(1, b"abc")), "bad_frame"),
    (msgpack.packb(msgpack.Timestamp(1, 0)), "bad_frame"),  # timestamps never travel
    (msgpack.packb([6, "r1"]) + b"\x00", "bad_frame"),  # trailing bytes
    (msgpack.packb([99, "x"]), "bad_type"),
    (msgpack.packb("hello"), "bad_type"),
    (msgpack.packb([True, "x"]), "bad_type"),
    (b"\x92\x06\xa2\xff\xfe", "bad_frame"),  # invalid utf-8
    (msgpack.packb([8, "c", "m", None, False, None]), None),  # valid
])
def test_handcrafted_frames(frame, code):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        if code is None:
            decode_or_refuse(frame)
        else:
            with pytest.raises(P.ProtocolError) as e:
                P.decode_message(frame)
            assert e.value.code == code
            assert e.value.message.strip() and not e.value.message.endswith(": ")  # says what is wrong
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0
    assert peak < len(frame) + (1 << 20)  # oversize declarations allocate nothing


@pytest.mark.parametrize("frame, at", [
    (b"\xc1garbage", 0),
    (b"\x93\x01\xc4\x03\xc1\xc1\xc1\xc1", 7),  # after a bin holding 0xc1 bytes: the value's own type byte
    (b"\x92\xcb" + b"\xc1" * 8 + b"\xc1", 10),  # after a float64 whose bytes are 0xc1
])
def test_a_reserved_byte_is_named_with_its_offset(frame, at):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(frame)
    assert e.value.code == "bad_frame"
    assert "FormatError" in e.value.message and f"0xc1 at byte {at}" in e.value.message


def test_frame_over_the_limit_is_refused_before_parsing():
    limits = P.Limits(max_frame_bytes=1000)
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(b"\x00" * 1001, limits)
    assert e.value.code == "too_large"
    big = P.encode_message(P.Error(code="x", message="y" * 900))
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(big, P.Limits(max_str_len=100))
    assert e.value.code == "too_large"


def test_non_bytes_frame_is_bad_frame():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message("a text frame")  # type: ignore[arg-type]
    assert e.value.code == "bad_frame"


def _decode_step(t: P.EncodedTensor) -> bytes:
    return P.encode_message(P.DecodeStep(request_id="r", position=0, hidden=t))


def test_zstd_bomb_declared_size_is_refused_at_the_frame():
    payload = zstandard.ZstdCompressor().compress(bytes(50_000_000))  # 50 MB of zeros, ~1.6 KB
    t = P.EncodedTensor(codec="fp16", shape=(1, 576), data=payload, zstd=True)
    with pytest.raises(P.ProtocolError) as e:
        P.decode_message(_decode_step(t))
    assert e.value.code == "decompress"


def test_zstd_bomb_without_declared_size_is_capped_by_the_codec():
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    with cctx.stream_writer(out := __import__("io").BytesIO(), closefd=False) as w:
        for _ in range(50):
            w.write(bytes(1_000_000))
    t = P.EncodedTensor(codec="fp16", shape=(1, 576), data=out.getvalue(), zstd=True)
    msg = P.decode_message(_decode_step(t))  # the header declares nothing: the frame passes
    t0 = time.perf_counter()
    with pytest.raises(P.ProtocolError) as e:
        C.get_codec("fp16").decode(msg.hidden)
    assert e.value.code == "decompress"
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_in_float_payloads_are_refused(codec, bad):
    c = C.get_codec(codec)
    t = c.encode(np.ones((2, 8), np.float32))
    arr = np.frombuffer(t.data, np.uint16).copy()
    arr[3] = np.float16(bad).view(np.uint16) if codec == "fp16" else (np.float32(bad).view(np.uint32) >> 16)
    msg = P.decode_message(_decode_step(P.EncodedTensor(codec=codec, shape=(1, 16), data=arr.tobytes())))
    with pytest.raises(P.ProtocolError) as e:
        c.decode(msg.hidden)
    assert e.value.code == "bad_tensor"
