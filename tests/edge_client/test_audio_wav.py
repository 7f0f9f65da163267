"""The phone's WAV reader (``edge_client.audio.decode_wav``) on files written by hand: no bundle, no server."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from media_support import tone, wav

from edge_client.audio import MAX_CHUNKS, decode_wav
from edge_client.vision import MediaError


def _chunk(cid: bytes, payload: bytes) -> bytes:
    return cid + struct.pack("<I", len(payload)) + payload + b"\0" * (len(payload) & 1)


def _wav_with_chunks(samples: np.ndarray, extra: list[bytes]) -> bytes:
    """16 kHz mono 16-bit WAV of ``samples`` with the chunks ``extra`` between its fmt and data chunks."""
    fmt = _chunk(b"fmt ", struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16))
    body = b"WAVE" + fmt + b"".join(extra) + _chunk(b"data", (samples * 32767).astype("<i2").tobytes())
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_a_wav_of_many_chunks_is_refused_and_one_of_a_few_is_read():
    """A WAV whose fmt tag is patched for ``wave`` was copied whole once per fmt chunk: 40,000 of them (976 KB) took
    120 s, 16 MB hours, a media thread and a core held meanwhile. A WAV has a handful of chunks before its samples
    (fmt, fact, LIST, bext, junk); over MAX_CHUNKS is bad_audio now, and those up to it are read."""
    x = tone(0.5)
    fmt = _chunk(b"fmt ", struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16))
    for extra in ([fmt] * 1000, [_chunk(b"junk", b"")] * (MAX_CHUNKS + 1)):
        with pytest.raises(MediaError) as e:
            decode_wav(_wav_with_chunks(x, extra))
        assert e.value.code == "bad_audio" and f"over {MAX_CHUNKS} chunks" in str(e.value), e.value
    reference, _ = decode_wav(wav(x))
    few = [fmt, _chunk(b"LIST", b"INFOISFT\x05\0\0\0Lavf\0"), _chunk(b"junk", bytes(3))] * 21  # 63 + fmt: 64
    samples, rate = decode_wav(_wav_with_chunks(x, few))
    assert rate == 16000 and np.array_equal(samples, reference)
