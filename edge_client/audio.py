"""The phone's audio path: WAV decode, Whisper log-mel features in numpy, the attached encoder's ONNX.

GLM-4.1V has no audio encoder; a bundle carries one only when ``split --audio-encoder`` attached it
(``partition_tools.export_audio``), and answers about audio are only as good as that encoder and its
projector. Features follow Whisper's (transformers' ``WhisperFeatureExtractor``): 16 kHz mono, 25 ms
periodic-Hann frames every 10 ms (reflect-padded, centred), power spectrum, Slaney mel filter bank,
``log10`` floored at 1e-10, clipped to 8 below the maximum, ``(x + 4) / 4``; the clip is zero-padded to the
encoder's window first, and only the rows that cover the clip become prompt tokens. A clip at another rate (a phone
records 44.1 or 48 kHz) is resampled to the encoder's first (``edge_client.resample``: polyphase Kaiser low-pass).

Bad input (empty, silent, not finite, sampled below MIN_SAMPLE_RATE or above MAX_SAMPLE_RATE, not a WAV of PCM or
float samples, longer than the window once resampled) raises ``MediaError``.
Only numpy and onnxruntime: this module runs on the phone.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .encoder_session import LazyEncoder, LazySession
from .resample import output_length, ratio_problem, resample
from .vision import MediaError

AUDIO = "edge/audio.onnx"
AUDIO_CONFIG = "edge/audio.json"
SILENCE_PEAK = 1e-4  # a clip whose samples all stay below this (of full scale) is silence
MAX_AUDIO_BYTES = 16 << 20
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4000, 384000  # Hz: a recording's rate outside these is a broken header
WAVE_PCM, WAVE_FLOAT, WAVE_EXTENSIBLE = 1, 3, 0xFFFE  # a WAV fmt chunk's format tags
KSDATAFORMAT_TAIL = bytes.fromhex("000000001000800000aa00389b71")  # an extensible sub-format GUID after its tag
STREAMED_SIZE = 0xFFFFFFFF  # a chunk size a writer that cannot seek back leaves in place: "to the end of the file"
SOX_UNSPEC = 0x7FFFF000  # SoX's (rec ... -t wav -), rounded down to whole frames: "the length is unknown"
MAX_CHUNKS = 64  # chunks before the samples: a WAV has a few (fmt, fact, LIST, bext, junk, ...)


@dataclass(frozen=True, slots=True)
class AudioSpec:
    """``edge/audio.json`` (written by ``partition_tools.export_audio``)."""

    sample_rate: int
    n_fft: int
    hop_length: int
    n_mels: int
    window_frames: int  # mel frames of one encoder window (Whisper: 3000 = 30 s)
    pool: int  # encoder frames stacked per audio token by the projector
    hidden_size: int
    audio_token_id: int

    @classmethod
    def load(cls, bundle_dir: str | Path) -> AudioSpec:
        path = Path(bundle_dir) / AUDIO_CONFIG
        if not path.is_file():
            raise MediaError("this bundle has no audio encoder (split with --audio-encoder to attach one)",
                             "no_encoder")
        return cls(**json.loads(path.read_text()))

    @property
    def max_samples(self) -> int:
        return self.window_frames * self.hop_length

    def tokens_for(self, n_samples: int) -> int:
        """Audio tokens of a clip of ``n_samples``: the rows covering it after the 2x conv and the pool."""
        frames = math.ceil(n_samples / self.hop_length)
        return math.ceil(math.ceil(frames / 2) / self.pool)


@dataclass(frozen=True, slots=True)
class PreparedAudio:
    features: np.ndarray  # float32 [1, n_mels, window_frames]
    n_tokens: int
    digest: bytes  # sha256 of the samples: the clip's identity in every cache
    seconds: float


# ------------------------------------------------------------------------------------------------
# features


def _hz_to_mel(f: np.ndarray) -> np.ndarray:  # Slaney: linear below 1 kHz, logarithmic above
    f = np.asarray(f, np.float64)
    mel = 3.0 * f / 200.0
    log_region = f >= 1000.0
    return np.where(log_region, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, np.float64)
    f = 200.0 * m / 3.0
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), f)


def mel_filters(sample_rate: int, n_fft: int, n_mels: int, f_max: float = 8000.0) -> np.ndarray:
    """Slaney-normalised triangular filters float64 [n_fft/2 + 1, n_mels] (transformers' mel_filter_bank)."""
    fft_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    filter_freqs = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(f_max), n_mels + 2))
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]  # [F, n_mels + 2]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    bank = np.maximum(0.0, np.minimum(down, up))
    return bank * (2.0 / (filter_freqs[2:n_mels + 2] - filter_freqs[:n_mels]))[None, :]


def log_mel(samples: np.ndarray, spec: AudioSpec) -> np.ndarray:
    """Whisper log-mel of ``samples`` float [n] zero-padded to the window: float32 [1, n_mels, window_frames]."""
    x = np.zeros(spec.max_samples, np.float64)
    x[: samples.size] = samples
    n_fft, hop = spec.n_fft, spec.hop_length
    padded = np.pad(x, n_fft // 2, mode="reflect")
    n_frames = 1 + (padded.size - n_fft) // hop
    idx = np.arange(n_fft)[None, :] + hop * np.arange(n_frames)[:, None]  # [frames, n_fft]
    window = np.hanning(n_fft + 1)[:-1]  # periodic Hann
    power = np.abs(np.fft.rfft(padded[idx] * window, n=n_fft, axis=-1)) ** 2  # [frames, F]
    mel = np.maximum(mel_filters(spec.sample_rate, n_fft, spec.n_mels).T @ power.T, 1e-10)  # [n_mels, frames]
    log = np.log10(mel)[:, :-1]  # Whisper drops the last frame
    log = np.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).astype(np.float32)[None]


# ------------------------------------------------------------------------------------------------
# decoding


def _riff_layout(data: bytes) -> tuple[int, bytearray, bool, int]:
    """A WAV's sample format (WAVE_PCM, WAVE_FLOAT or another tag; WAVE_FORMAT_EXTENSIBLE's sub-format read
    through), ``data`` with that fmt tag set to PCM where it is PCM or float, so that stdlib ``wave`` (PCM
    only; Python 3.11 not even extensible PCM, which ffmpeg writes for 24-bit or multichannel audio) reads it,
    and whether its data chunk is streamed - size 0 (a header's placeholder never filled in) or 0xFFFFFFFF, what ffmpeg writes to a pipe (``-f wav -``), which
    cannot seek back to fill it in, or the whole frames of SOX_UNSPEC, what SoX writes there: the samples run to the
    end of the file -, and the bytes after its data chunk's header (0 without one): the most its samples can hold.
    The RIFF size is not read: the copy's is set to the file's (as ffmpeg reads a WAV: the data chunk's size says
    where the samples end; a RIFF size of 0, or the data's alone, was 'not a WAVE file' or 'truncated').
    One copy of ``data``, its fmt tags set in place, and a file of over MAX_CHUNKS chunks before its samples
    refused: bytes of tiny chunks cost a Python loop turn each, here and in ``wave`` (16 MB of them: 16 s)."""
    tag, pos, out, chunks, align = WAVE_PCM, 12, bytearray(data), 0, 0  # no fmt chunk: wave says what is wrong
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":  # the RIFF size as the file's: ``wave`` reads no chunk past
        out[4:8] = (len(data) - 8).to_bytes(4, "little")  # the one it declares, and writers leave it 0 or wrong
    while data[:4] == b"RIFF" and data[8:12] == b"WAVE" and pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "little")
        if cid == b"data":
            streamed = size in (0, STREAMED_SIZE) or (align > 0 and size == SOX_UNSPEC // align * align)  # 0: a
            # recorder's placeholder, never filled in (an app stopped mid-recording), as ffmpeg reads it
            room = max(len(data) - pos - 8, 0)
            if streamed:  # the copy's size is what the file holds: ``wave`` reads no sample past the declared size
                out[pos + 4:pos + 8] = room.to_bytes(4, "little")
            return tag, out, streamed, room
        if (chunks := chunks + 1) > MAX_CHUNKS:
            raise MediaError(f"not a WAV file (over {MAX_CHUNKS} chunks before its samples)", "bad_audio")
        if cid == b"fmt " and pos + 10 <= len(data):
            tag = int.from_bytes(data[pos + 8:pos + 10], "little")
            align = int.from_bytes(data[pos + 20:pos + 22], "little")  # nBlockAlign: bytes a frame
            sub = data[pos + 32:pos + 48]  # WAVEFORMATEXTENSIBLE's SubFormat GUID: its format tag, then a fixed tail
            if tag == WAVE_EXTENSIBLE and size >= 40 and sub[2:] == KSDATAFORMAT_TAIL:
                tag = int.from_bytes(sub[:2], "little")
            if tag in (WAVE_PCM, WAVE_FLOAT):
                out[pos + 8:pos + 10] = WAVE_PCM.to_bytes(2, "little")
        pos += 8 + size + (size & 1)
    return tag, out, False, 0


@dataclass(frozen=True, slots=True)
class WavHeader:
    """What a WAV file's header says (:func:`wav_header`), checked: its samples not read yet."""

    tag: int  # WAVE_PCM or WAVE_FLOAT
    streamed: bool  # a data chunk of size STREAMED_SIZE: its samples run to the end of the file
    rate: int
    width: int  # bytes per sample
    channels: int
    declared: int  # the frames the header declares
    held: int  # the frames the file's bytes after the data chunk's header hold

    @property
    def frames(self) -> int:
        """The clip's length at most: the frames declared (streamed: to the file's end), at most those held."""
        return self.held if self.streamed else min(self.declared, self.held)


def _wave(data: bytearray, frames: int) -> tuple[int, int, int, int, bytes]:
    """stdlib ``wave`` over a :func:`_riff_layout` result: (rate, sample width, channels, the frames the header
    declares, the bytes of the first ``frames`` frames)."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            return w.getframerate(), w.getsampwidth(), w.getnchannels(), w.getnframes(), w.readframes(frames)
    except (wave.Error, EOFError, RuntimeError) as e:  # RuntimeError: wave's seek past a chunk the file lacks
        raise MediaError(f"not a WAV file ({str(e) or 'cut short inside its chunks'})", "bad_audio") from None


def _read_header(data: bytes, max_bytes: int) -> tuple[bytearray, WavHeader]:
    """Every check of a WAV file's header: (the :func:`_riff_layout` bytes ``wave`` reads, the header)."""
    if not data:
        raise MediaError("empty audio (0 bytes)", "bad_audio")
    if len(data) > max_bytes:
        raise MediaError(f"audio of {len(data)} bytes exceeds the {max_bytes}-byte limit", "audio_too_large")
    tag, out, streamed, room = _riff_layout(data)
    if tag not in (WAVE_PCM, WAVE_FLOAT):
        raise MediaError(f"WAV sample format {tag:#06x} (accepted: integer PCM, float)", "unsupported_format")
    rate, width, channels, n, _ = _wave(out, 0)
    if width not in ((4, 8) if tag == WAVE_FLOAT else (1, 2, 3, 4)):
        raise MediaError(f"unsupported WAV sample width {width * 8} bits{' (float)' if tag == WAVE_FLOAT else ''}",
                         "unsupported_format")
    return out, WavHeader(tag, streamed, rate, width, channels, n, room // (width * channels))


def wav_header(data: bytes, max_bytes: int = MAX_AUDIO_BYTES) -> WavHeader:
    """A WAV file's header, read and checked as :func:`decode_wav` does, no sample read: the clip's rate and length
    before it is decoded (16 MB of 8-bit samples take 160 MB on the way to mono float32)."""
    return _read_header(data, max_bytes)[1]


def decode_wav(data: bytes, max_bytes: int = MAX_AUDIO_BYTES) -> tuple[np.ndarray, int]:
    """A WAV file of integer PCM (8-, 16-, 24- or 32-bit) or float samples (32- or 64-bit), any channels, plain
    or WAVE_FORMAT_EXTENSIBLE -> (mono float32 samples, integers scaled to [-1, 1]; sample rate)."""
    data, h = _read_header(data, max_bytes)
    tag, rate, width, channels, n = h.tag, h.rate, h.width, h.channels, h.declared
    raw = _wave(data, n)[4]
    if h.streamed:  # whole frames to the end of the file
        n = len(raw) // (width * channels)
    elif len(raw) < n * width * channels:  # the data chunk ends before the frames its header declares
        raise MediaError(f"truncated WAV: {len(raw) // (width * channels)} of the {n} frames its header declares",
                         "bad_audio")
    raw = raw[: n * width * channels]
    if tag == WAVE_FLOAT:  # as stored: not clipped (check_audio refuses NaN and infinities)
        x = np.frombuffer(raw, f"<f{width}").astype(np.float32)
    elif width == 1:  # unsigned 8-bit
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    else:  # signed little-endian; 24-bit samples become the top three bytes of an int32
        if width == 3:
            padded = np.zeros((len(raw) // 3, 4), np.uint8)
            padded[:, 1:] = np.frombuffer(raw, np.uint8).reshape(-1, 3)
            raw, width = padded.tobytes(), 4
        x = np.frombuffer(raw, f"<i{width}").astype(np.float32) / float(1 << (8 * width - 1))
    return x.reshape(-1, channels).mean(axis=1), rate


def check_fits(n_samples: int, sample_rate: int, spec: AudioSpec) -> int:
    """A clip of ``n_samples`` at ``sample_rate`` -> its samples at the encoder's rate (:func:`check_audio` resamples
    it there); refused if sampled outside [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE], at an odd rate the resampler does not
    take (``edge_client.resample.ratio_problem``) or longer than the encoder's window."""
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise MediaError(f"audio at {sample_rate} Hz: the sample rate must be within {MIN_SAMPLE_RATE}.."
                         f"{MAX_SAMPLE_RATE} Hz (the encoder takes {spec.sample_rate} Hz; other rates are resampled)",
                         "bad_sample_rate")
    if (problem := ratio_problem(sample_rate, spec.sample_rate)) is not None:
        raise MediaError(f"audio at {problem}", "bad_sample_rate")
    n = output_length(n_samples, sample_rate, spec.sample_rate)
    if n > spec.max_samples:
        raise MediaError(f"audio of {n_samples / sample_rate:.1f} s exceeds the encoder's "
                         f"{spec.max_samples / spec.sample_rate:.1f} s window", "audio_too_long")
    return n


def check_audio(samples: np.ndarray, sample_rate: int, spec: AudioSpec) -> np.ndarray:
    """Samples at ``sample_rate`` -> float32 [n] at the encoder's rate (resampled, ``edge_client.resample``);
    refuses wrongly sampled, too long, empty, not finite or silent clips (silent at the encoder's rate: a clip of
    only ultrasound is)."""
    x = np.asarray(samples, np.float32).reshape(-1)
    check_fits(x.size, sample_rate, spec)
    if x.size == 0:
        raise MediaError("empty audio (no samples)", "bad_audio")
    if not np.isfinite(x).all():
        raise MediaError("audio samples are not finite", "bad_audio")
    x = resample(x, sample_rate, spec.sample_rate)
    if float(np.abs(x).max()) < SILENCE_PEAK:
        raise MediaError("the audio is silent", "silent_audio")
    return x


def prepare_audio(samples: np.ndarray, sample_rate: int, spec: AudioSpec) -> PreparedAudio:
    """Samples -> :class:`PreparedAudio` (:func:`check_audio`, then :func:`checked_audio`)."""
    return checked_audio(check_audio(samples, sample_rate, spec), spec)


def checked_audio(x: np.ndarray, spec: AudioSpec) -> PreparedAudio:
    """A :func:`check_audio` result -> :class:`PreparedAudio`: its log-mel features and digest."""
    digest = hashlib.sha256(b"audio/v1" + x.astype("<f4").tobytes()).digest()
    return PreparedAudio(log_mel(x, spec), spec.tokens_for(x.size), digest, x.size / spec.sample_rate)


class AudioEncoder(LazyEncoder):
    """``edge/audio.onnx`` of a bundle, opened on first use; one clip per ``encode`` call."""

    def __init__(self, bundle_dir: str | Path, threads: int = 2):
        self.bundle_dir = Path(bundle_dir)
        self.spec = AudioSpec.load(self.bundle_dir)
        self.graph = LazySession(self.bundle_dir / AUDIO, threads, "an audio encoder")

    def prepare(self, data: bytes) -> PreparedAudio:
        """WAV bytes -> :class:`PreparedAudio` (:meth:`check`, then :meth:`prepared`)."""
        return self.prepared(self.check(data)[0])

    def check(self, data: bytes) -> tuple[bytes, int]:
        """WAV bytes -> (the bytes, the clip's audio tokens), from the header alone (:func:`wav_header`): a clip at
        a rate outside the bounds or longer than the encoder's window once resampled is refused, nothing is decoded
        yet."""
        h = wav_header(data)
        return data, self.spec.tokens_for(check_fits(h.frames, h.rate, self.spec))

    def prepared(self, data: bytes) -> PreparedAudio:
        """A :meth:`check` result's bytes -> :class:`PreparedAudio`: decoded, :func:`check_audio` (empty, not
        finite, silent), the log-mel features."""
        return checked_audio(check_audio(*decode_wav(data), self.spec), self.spec)

    def encode(self, clip: PreparedAudio) -> np.ndarray:
        """Audio embeddings float32 [n_tokens, H] of one clip."""
        out = self.graph.run("audio_embeds", {"input_features": clip.features})  # [window tokens, H]
        return out[: clip.n_tokens]

    def warmup(self) -> float:
        t0 = time.perf_counter()
        tone = 0.1 * np.sin(np.arange(self.spec.sample_rate // 10) * 0.05)
        self.encode(prepare_audio(tone, self.spec.sample_rate, self.spec))
        return time.perf_counter() - t0
