"""The phone's WAV reader (``edge_client.audio.decode_wav``) on files written by hand: no bundle, no server."""

from __future__ import annotations

import json
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


def _pcm8(seconds: float, rate: int) -> bytes:
    """An 8-bit mono PCM WAV of a tone lasting ``seconds`` at ``rate`` (one byte a sample: the longest clip a byte
    budget holds)."""
    x = tone(seconds, rate)
    body = (b"WAVE" + _chunk(b"fmt ", struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8))
            + _chunk(b"data", (x * 127 + 128).astype(np.uint8).tobytes()))
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _spec_only_bundle(path, window_frames: int):
    """A bundle directory holding only ``edge/audio.json`` (Whisper's mel parameters): checking and decoding a clip
    need no graph."""
    from edge_client.audio import AUDIO_CONFIG

    (path / AUDIO_CONFIG).parent.mkdir()
    (path / AUDIO_CONFIG).write_text(json.dumps(dict(
        sample_rate=16000, n_fft=400, hop_length=160, n_mels=80, window_frames=window_frames, pool=2, hidden_size=64,
        audio_token_id=16)))
    return path


def _peak(run) -> tuple[object, int]:
    """``run()``'s result and the most memory it held at once (tracemalloc: numpy's arrays included)."""
    import tracemalloc

    tracemalloc.start()
    try:
        return run(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_wav_too_long_or_at_another_rate_is_refused_from_its_header(tmp_path):
    """An hour at 1 kHz (3.6 MB) or 15 minutes at 16 kHz (14 MB), both within the 16 MB limit, were decoded whole
    (~10x their bytes as float32: 160 MB for 16 MB) before bad_sample_rate / audio_too_long refused them; the
    header's rate and frames are checked before any sample is read, and a clip that fits is read as before."""
    from edge_client.audio import AudioEncoder

    enc = AudioEncoder(_spec_only_bundle(tmp_path, 3000))  # Whisper's window: 30 s
    for data, code in ((_pcm8(3600, 1000), "bad_sample_rate"), (_pcm8(900, 16000), "audio_too_long")):
        def refused():
            with pytest.raises(MediaError) as e:
                enc.check(data)  # noqa: B023 - run here, in this turn
            return e.value
        err, peak = _peak(refused)
        size = len(data)
        assert err.code == code and peak < 3 * size, (err, peak, size)
    data, n = enc.check(_pcm8(30, 16000))
    assert n == enc.spec.tokens_for(30 * 16000) and enc.prepared(data).n_tokens == n


def test_a_clips_check_reads_its_header_and_items_decode_it(tmp_path):
    """``MediaEncoders.check``, which requests run side by side (local_api.MEDIA_THREADS), decoded each clip whole:
    four 16 MB WAVs that fit the window (2 s of 500 channels of 8 bits) held 500 MB at once where one takes 170 MB.
    The check reads the header (the rows counted from it) and ``items``, one request at a time
    (``MediaEncoders.turn``), decodes, as for images."""
    from edge_client.media import MediaEncoders, MediaPart, MediaPolicy

    media = MediaEncoders(_spec_only_bundle(tmp_path, 200))  # the tiny preset's window: 2 s
    x = tone(2.0)
    channels = 500
    pcm = np.repeat((x * 127 + 128).astype(np.uint8)[:, None], channels, axis=1).tobytes()  # [frames, channels]
    body = (b"WAVE" + _chunk(b"fmt ", struct.pack("<HHIIHH", 1, channels, 16000, 16000 * channels, channels, 8))
            + _chunk(b"data", pcm))
    data = b"RIFF" + struct.pack("<I", len(body)) + body
    checked, peak = _peak(lambda: media.check([MediaPart("audio", data)], MediaPolicy()))
    size = len(data)
    assert peak < 3 * size, (peak, size)
    (item,) = media.items(checked, MediaPolicy())  # decoded: every channel the same, the mono clip is that channel
    samples, _ = decode_wav(data)
    assert item.rows == media.audio.spec.tokens_for(x.size) and samples.size == x.size
    assert np.array_equal(samples, (np.frombuffer(pcm, np.uint8)[::channels].astype(np.float32) - 128) / 128)


def test_base64_audio_over_the_limit_is_refused_before_it_is_decoded():
    """An input_audio part's base64 (or a data: URL's) was decoded whole before its size was checked: an hour of
    WAV, 154 MB of base64, took 4.5 s and 131 MB on the phone before audio_too_large. Its length says enough: refused
    with no copy of it, and one within the limit, in base64's 76-character lines, is read as before."""
    import base64

    from edge_client.audio import MAX_AUDIO_BYTES
    from edge_client.media import MediaPolicy, extract_parts, load_source

    big = _pcm8(1.0, 16000)[:44] + bytes(MAX_AUDIO_BYTES)  # the header of a short clip, then 16 MB of samples
    text = base64.b64encode(big).decode()
    part, size = {"type": "input_audio", "input_audio": {"data": text, "format": "wav"}}, len(text)
    url = "data:audio/wav;base64," + text
    # (how it is called, its limit, the most it may hold: a data: URL's payload is split off it, a copy)
    for run, limit, most in ((lambda: extract_parts([{"role": "user", "content": [part]}], str), MAX_AUDIO_BYTES, 0),
                             (lambda: load_source(url, MediaPolicy(max_bytes=1 << 20), "audio"), 1 << 20, size)):
        def refused():
            with pytest.raises(MediaError) as e:
                run()  # noqa: B023 - run here, in this turn
            return e.value
        err, peak = _peak(refused)
        assert err.code == "audio_too_large" and f"the {limit}-byte limit" in str(err), err
        assert peak < most + size // 4, (peak, size)  # slices of it counted; decoded whole: 3/4 of it at least
    clip = _pcm8(1.0, 16000)
    _, parts = extract_parts([{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.encodebytes(clip).decode(), "format": "wav"}}]}], str)
    assert parts[0].source == clip


def test_a_wav_sox_wrote_to_a_pipe_is_read_to_its_end():
    """SoX writing a WAV it cannot seek back in (``rec -r 16000 -c 1 -b 16 -t wav -``, a stream of unknown length)
    leaves the data size 0x7ffff000 rounded down to whole frames ('unspecified', as its own reader takes it), as
    ffmpeg leaves 0xFFFFFFFF: the file was refused as truncated; its samples are read to the end of the file, as
    ffmpeg's are. Any other size past the end is still a truncated WAV."""
    x = tone(0.5)
    reference, _ = decode_wav(wav(x))
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    fmt = _chunk(b"fmt ", struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16))

    def sox(size: int, samples: bytes) -> bytes:  # wavwritehdr's layout: RIFF length from the data size
        return (b"RIFF" + struct.pack("<I", 4 + len(fmt) + 8 + size) + b"WAVE" + fmt + b"data"
                + struct.pack("<I", size) + samples)

    samples, rate = decode_wav(sox(0x7FFFF000 // 2 * 2, pcm))
    assert rate == 16000 and np.array_equal(samples, reference)
    samples, _ = decode_wav(sox(0x7FFFF000 // 2 * 2, pcm + b"\x01"))  # a partial frame at the end: dropped
    assert np.array_equal(samples, reference)
    with pytest.raises(MediaError) as e:
        decode_wav(sox(0x7FFFF000 - 2, pcm))
    assert e.value.code == "bad_audio" and "truncated" in str(e.value)
