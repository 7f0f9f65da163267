"""shared.compression: bounded zstd. Bombs, lying headers, oversized windows and junk never allocate past the cap."""

from __future__ import annotations

import io
import time
import tracemalloc

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import protocol as P
from shared.compression import compress, decompress


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=4096), st.integers(1, 19))
def test_round_trip(data, level):
    assert decompress(compress(data, level), max_output=len(data)) == data


def test_own_frames_declare_their_size():
    assert zstandard.frame_content_size(compress(b"abc" * 100)) == 300


def _refused(data: bytes, **kw) -> str:
    with pytest.raises(P.ProtocolError) as e:
        decompress(data, **kw)
    assert e.value.code == "decompress"
    return e.value.message


def test_declared_size_over_the_cap_is_refused_before_allocation():
    bomb = zstandard.ZstdCompressor().compress(bytes(200_000_000))  # declares 200 MB in ~6 KB
    tracemalloc.start()
    t0 = time.perf_counter()
    msg = _refused(bomb, max_output=1 << 20)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "declares" in msg and peak < 1 << 20 and time.perf_counter() - t0 < 0.5


def test_ratio_cap():
    frame = compress(bytes(100_000))
    _refused(frame, max_output=1 << 20, max_ratio=10)
    assert decompress(frame, max_output=1 << 20, max_ratio=1e6) == bytes(100_000)


def test_undeclared_size_is_capped_while_decoding():
    out = io.BytesIO()
    with zstandard.ZstdCompressor(write_content_size=False).stream_writer(out, closefd=False) as w:
        for _ in range(100):
            w.write(bytes(1_000_000))  # 100 MB
    t0 = time.perf_counter()
    _refused(out.getvalue(), max_output=1 << 16)
    assert time.perf_counter() - t0 < 1.0


def test_large_window_is_refused():
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27, write_content_size=True)
    frame = zstandard.ZstdCompressor(compression_params=params).compress(bytes(range(256)) * 8)
    header = zstandard.get_frame_parameters(frame)
    if header.window_size <= 1 << 23:  # zstd shrinks the window for small inputs; force a big one
        params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27, write_content_size=False)
        out = io.BytesIO()
        with zstandard.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as w:
            w.write(bytes(range(256)) * 8)
        frame = out.getvalue()
    assert zstandard.get_frame_parameters(frame).window_size > 1 << 23
    assert "window" in _refused(frame, max_output=1 << 20, window_log_max=23)


def test_trailing_data_and_second_frames_are_refused():
    f = compress(b"hello world" * 10)
    _refused(f + b"\x00", max_output=1000)
    _refused(f + f, max_output=1000)


def test_skippable_and_dictionary_frames_are_refused():
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd"
    _refused(skippable, max_output=1000)
    d = zstandard.train_dictionary(1024, [bytes([i % 7] * 64 + [i % 11] * 64) for i in range(200)])
    frame = zstandard.ZstdCompressor(dict_data=d).compress(bytes([3] * 64 + [5] * 64))
    _refused(frame, max_output=1000)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_junk_after_the_magic(junk):
    try:
        out = decompress(b"\x28\xb5\x2f\xfd" + junk, max_output=4096)
    except P.ProtocolError as e:
        assert e.code == "decompress"
    else:
        assert len(out) <= 4096


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.data())
def test_truncated_or_flipped_frames(data, draw):
    frame = bytearray(compress(data))
    if draw.draw(st.booleans()):
        frame = frame[:draw.draw(st.integers(0, len(frame) - 1))]
    else:
        i = draw.draw(st.integers(0, len(frame) - 1))
        frame[i] ^= draw.draw(st.integers(1, 255))
    try:
        out = decompress(bytes(frame), max_output=len(data))
    except P.ProtocolError as e:
        assert e.code == "decompress"
    else:
        assert len(out) <= len(data)


def test_bad_arguments_are_programming_errors():
    with pytest.raises(ValueError):
        compress(b"x", level=0)
    with pytest.raises(ValueError):
        decompress(compress(b"x"), max_output=-1)
