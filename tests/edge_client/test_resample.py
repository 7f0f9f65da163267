"""The phone's resampler (``edge_client.resample``) and the audio path's rate rules (``edge_client.audio``), no
bundle: against ``scipy.signal.resample_poly`` (a test reference only; the phone has no scipy), on analytic sines
(frequency and amplitude kept in the passband, aliases of tones above the output's Nyquist frequency gone), and
the log-mel features of one band-limited clip recorded at the rates phones use."""

from __future__ import annotations

import time

import numpy as np
import pytest
from media_support import voice, wav
from scipy.signal import resample_poly

from edge_client.audio import (
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    AudioSpec,
    check_audio,
    check_fits,
    checked_audio,
    decode_wav,
    prepare_audio,
)
from edge_client.resample import MAX_PHASES, design, output_length, resample
from edge_client.vision import MediaError

PHONE_RATES = (8000, 11025, 22050, 24000, 32000, 44100, 48000, 96000)
SPEC = AudioSpec(sample_rate=16000, n_fft=400, hop_length=160, n_mels=80, window_frames=200, pool=2,
                 hidden_size=64, audio_token_id=5)  # the tiny preset's: a 2 s window


def _prototype(rate_in: int, rate_out: int) -> np.ndarray:
    """The designed filter as one FIR float64 [2 * half + 1], in resample_poly's scaling (unit DC gain)."""
    f = design(rate_in, rate_out)
    return f.phases[:, ::-1].T.reshape(-1)[: 2 * f.half + 1].astype(np.float64) / f.up


@pytest.mark.parametrize("rate", [*PHONE_RATES, 384000])
def test_the_polyphase_arithmetic_is_resample_polys(rate):
    """Given the same filter, the polyphase sum is scipy's upfirdn: the same length, alignment and values."""
    x = np.random.default_rng(rate).standard_normal(rate // 4 + 7).astype(np.float32)  # not a whole number of phases
    f = design(rate, 16000)
    ref = resample_poly(x.astype(np.float64), f.up, f.down, window=_prototype(rate, 16000))
    y = resample(x, rate, 16000)
    assert y.shape == ref.shape == (output_length(x.size, rate, 16000),)
    assert np.abs(y - ref).max() < 1e-5


@pytest.mark.parametrize("rate", [44100, 48000, 22050, 8000])
def test_a_band_limited_signal_matches_resample_polys_own_design(rate):
    """Independently of the filter: scipy's default design gives the same samples of a signal well inside both
    passbands (harmonics of 200 Hz up to 3.4 kHz)."""
    t = np.arange(rate // 2) / rate
    x = sum(np.sin(2 * np.pi * 200 * k * t + k) / k for k in range(1, 18)).astype(np.float32)
    up, down = design(rate, 16000).up, design(rate, 16000).down
    ref = resample_poly(x.astype(np.float64), up, down)
    y = resample(x, rate, 16000)
    inner = slice(400, -400)  # the ends: each filter's own transient against the zero padding
    assert np.abs(y - ref)[inner].max() < 2e-3 * np.abs(ref).max()


def _fit(y: np.ndarray, freq: float, rate: int) -> tuple[float, float]:
    """(amplitude of ``freq`` in ``y``, rms of what is left once it is taken out): least squares on sin and cos."""
    t = np.arange(y.size) / rate
    a = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], axis=1)
    c = np.linalg.lstsq(a, y.astype(np.float64), rcond=None)[0]
    return float(np.hypot(*c)), float(np.sqrt(np.mean((y - a @ c) ** 2)))


@pytest.mark.parametrize("rate", [*PHONE_RATES, 384000])
def test_a_sine_keeps_its_frequency_and_amplitude_and_aliases_are_60_db_down(rate):
    """Tones up to 0.9 of the band edge (7.2 kHz out of 16 kHz) come out at their frequency, their amplitude within
    0.1 dB and nothing else beside them (images of an upsampled tone included) 60 dB down; a tone at or above
    8 kHz, which would alias below it, comes out at least 60 dB down."""
    band = min(rate, 16000) / 2
    t = np.arange(rate // 2) / rate
    inner = slice(1000, -1000)
    for freq in np.linspace(60, 0.9 * band, 9):
        y = resample(0.5 * np.sin(2 * np.pi * freq * t), rate, 16000)[inner]
        amplitude, rest = _fit(y, freq, 16000)
        assert abs(20 * np.log10(amplitude / 0.5)) < 0.1, (rate, freq)
        assert 20 * np.log10(rest * np.sqrt(2) / 0.5) < -60, (rate, freq)
    for freq in np.linspace(8000, 0.999 * rate / 2, 9) if rate > 16000 else ():
        y = resample(0.5 * np.sin(2 * np.pi * freq * t), rate, 16000)[inner]
        assert 20 * np.log10(np.sqrt(2 * np.mean(y.astype(np.float64) ** 2)) / 0.5) < -60, (rate, freq)


@pytest.mark.parametrize("rate", PHONE_RATES)
def test_a_clip_at_a_phones_rate_gives_the_16_khz_clips_features(rate):
    """A WAV at 8 to 96 kHz was refused (bad_sample_rate: 'resample first'); it is resampled, and the log-mel
    features of one sound recorded at ``rate`` are those of the same sound at 16 kHz (max abs difference 0.02 on
    features of range 2; measured 0.003 to 0.010), the same audio tokens."""
    top = min(7000.0, 0.9 * rate / 2)
    ref = checked_audio(check_audio(*decode_wav(wav(voice(0.9, 16000, top))), SPEC), SPEC)
    clip = checked_audio(check_audio(*decode_wav(wav(voice(0.9, rate, top), rate)), SPEC), SPEC)
    assert clip.n_tokens == ref.n_tokens and clip.seconds == pytest.approx(0.9)
    assert np.abs(clip.features - ref.features).max() < 0.02


def test_the_rate_bounds_and_the_window_after_resampling():
    """A rate outside [4 kHz, 384 kHz] is a broken header (bad_sample_rate, the bounds named); the window is in
    seconds at any rate: 2 s at 48 kHz fits the tiny preset's 2 s window, a sample more does not."""
    for rate in (MIN_SAMPLE_RATE - 1, MAX_SAMPLE_RATE + 1, 0):
        with pytest.raises(MediaError, match=f"{MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz") as e:
            check_fits(1000, rate, SPEC)
        assert e.value.code == "bad_sample_rate"
    assert check_fits(96000, 48000, SPEC) == SPEC.max_samples
    assert check_fits(88200, 44100, SPEC) == SPEC.max_samples
    with pytest.raises(MediaError, match="2.0 s exceeds the encoder's 2.0 s window") as e:
        check_fits(96001, 48000, SPEC)
    assert e.value.code == "audio_too_long"
    assert check_fits(MIN_SAMPLE_RATE, MIN_SAMPLE_RATE, SPEC) == 16000


def test_an_odd_rate_in_a_header_is_refused_before_any_filter_is_designed():
    """A WAV header may say any rate within the bounds: 383,999 Hz (16,000 filter phases) took 9 s and 3.3 GB to
    design, 44,099 Hz 1 s and 0.4 GB (a few KB of WAV, on the phone); such a ratio is bad_sample_rate from the header,
    at once, and every recording rate (at most 640 phases: 11.025 kHz) is still taken."""
    design.cache_clear()
    for rate in (383999, 44099, 47952):  # the last: 48 kHz x 1000/1001, a video's pull-down
        began = time.perf_counter()
        with pytest.raises(MediaError, match="no recording rate this resampler takes") as e:
            prepare_audio(*decode_wav(wav(np.full(rate // 10, 0.1, np.float32), rate)), SPEC)
        assert e.value.code == "bad_sample_rate" and time.perf_counter() - began < 0.5
        with pytest.raises(ValueError):
            design(rate, 16000)
    assert design.cache_info().currsize == 0
    for rate in (*PHONE_RATES, 12000, 88200, 176400, 192000, 352800, MAX_SAMPLE_RATE):
        assert check_fits(rate // 10, rate, SPEC) == 1600
        assert design(rate, 16000).up <= MAX_PHASES


def test_a_clip_of_ultrasound_only_is_silent_to_the_encoder():
    """Silence is judged at the encoder's rate: a 20 kHz tone at 48 kHz (peak 0.1, faded in and out) leaves nothing
    below 8 kHz."""
    t = np.arange(24000) / 48000
    fade = 0.5 - 0.5 * np.cos(np.pi * np.clip(np.minimum(t, t[-1] - t) / 0.02, 0, 1))
    with pytest.raises(MediaError) as e:
        check_audio(0.1 * fade * np.sin(2 * np.pi * 20000 * t), 48000, SPEC)
    assert e.value.code == "silent_audio"
