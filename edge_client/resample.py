"""Rational-ratio sample-rate conversion in numpy: a polyphase windowed-sinc (Kaiser) low-pass.

A clip at ``rate_in`` becomes one at ``rate_out`` through the ratio ``up / down`` (both divided by their gcd:
44.1 kHz -> 16 kHz is 160 / 441). Conceptually the clip is zero-stuffed by ``up``, low-pass filtered at the
upsampled rate and kept every ``down``-th sample; the polyphase form computes only the kept samples, each the
dot product of ``taps`` input samples with one of the filter's ``up`` phases. Output sample ``k`` lies
at time ``k / rate_out`` (no delay: the filter is centred), the clip's ends are padded with zeros, and the
output has ``ceil(n * up / down)`` samples, the convention (and, given the same filter, the values) of
``scipy.signal.resample_poly``.

The filter (:func:`design`): the band edge ``F`` is the lower of the two Nyquist frequencies; the passband runs to
``PASS_EDGE * F``, the stopband starts at ``F`` (nothing above the output's Nyquist frequency aliases into the clip, and
an upsampled clip keeps no images above the input's), and the Kaiser window is sized for ``ATTENUATION_DB`` there
(ripple in the passband below 0.01 dB). At 16 kHz out: flat to 7.2 kHz, >= 60 dB from 8 kHz.

Only numpy: this module runs on the phone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

PASS_EDGE = 0.9  # the passband's end, a fraction of the band edge F (the lower Nyquist frequency)
ATTENUATION_DB = 65.0  # the Kaiser design's stopband attenuation (and passband ripple 10^(-65/20))
# The most filter phases (``up``) a ratio may take. The filter holds ~ up x taps values (taps ~ 5e-3 x the faster
# rate): a recording's rate makes at most 640 (11.025 kHz -> 16 kHz; 44.1 kHz takes 160, 8 / 48 / 96 kHz 1 or 2),
# while an odd rate in a header (44,099 Hz: 16,000 phases) took 0.4 GB and 1 s to design, 383,999 Hz 3.3 GB and 9 s
MAX_PHASES = 640


@dataclass(frozen=True, slots=True)
class Polyphase:
    """A designed resampler: the ratio and the filter's phases."""

    up: int
    down: int
    half: int  # the prototype filter's centre: output k's newest input is (k * down + half) // up
    phases: np.ndarray  # float32 [up, taps]: phase p's taps in input order (oldest first), scaled by up

    @property
    def taps(self) -> int:
        return self.phases.shape[1]


def ratio(rate_in: int, rate_out: int) -> tuple[int, int]:
    """(up, down): ``rate_out / rate_in`` in lowest terms."""
    g = math.gcd(rate_in, rate_out)
    return rate_out // g, rate_in // g


def ratio_problem(rate_in: int, rate_out: int) -> str | None:
    """Why ``rate_in -> rate_out`` is not resampled here (its ratio in lowest terms needs more than
    :data:`MAX_PHASES` filter phases), or None."""
    up, _ = ratio(rate_in, rate_out)
    if up > MAX_PHASES:
        return (f"{rate_in} Hz is no recording rate this resampler takes ({rate_out} / {rate_in} in lowest terms "
                f"needs {up} filter phases, at most {MAX_PHASES}: 8, 11.025, 12, 22.05, 24, 32, 44.1, 48, 88.2, 96, "
                "176.4, 192 kHz and the like are taken)")
    return None


@lru_cache(maxsize=8)
def design(rate_in: int, rate_out: int) -> Polyphase:
    """The Kaiser windowed-sinc low-pass for ``rate_in -> rate_out`` (the module docstring's band edges), split into
    its ``up`` phases; a ratio of more than :data:`MAX_PHASES` is a ValueError (:func:`ratio_problem`)."""
    if (problem := ratio_problem(rate_in, rate_out)) is not None:
        raise ValueError(problem)
    up, down = ratio(rate_in, rate_out)
    fs = rate_in * up  # the upsampled rate the prototype filter runs at
    band = min(rate_in, rate_out) / 2  # F
    width = 2 * math.pi * (1 - PASS_EDGE) * band / fs  # the transition band, radians a sample
    beta = 0.1102 * (ATTENUATION_DB - 8.7)  # Kaiser's formulas (Oppenheim & Schafer 7.62, 7.63)
    half = math.ceil((ATTENUATION_DB - 7.95) / (2.285 * width) / 2)
    j = np.arange(-half, half + 1)  # [2 * half + 1]
    cutoff = (1 + PASS_EDGE) / 2 * band / (fs / 2)  # the transition's middle, a fraction of the upsampled Nyquist
    h = cutoff * np.sinc(cutoff * j) * np.kaiser(j.size, beta)
    h *= up / h.sum()  # unit gain at DC after the zero-stuffing
    taps = -(-h.size // up)
    padded = np.zeros(taps * up)
    padded[:h.size] = h
    # output k sits at upsampled index k * down; input n at n * up; tap j of h at offset j - half from the output.
    # Phase p = (k * down + half) % up takes h[p], h[p + up], ... against inputs q, q - 1, ... (q = (k*down+half)//up)
    phases = padded.reshape(taps, up).T[:, ::-1]  # [up, taps], oldest input first
    return Polyphase(up, down, half, np.ascontiguousarray(phases, np.float32))


def output_length(n: int, rate_in: int, rate_out: int) -> int:
    """Samples of :func:`resample`'s output for ``n`` input samples: ``ceil(n * up / down)``."""
    up, down = ratio(rate_in, rate_out)
    return -(-n * up // down)


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """float [n] at ``rate_in`` -> float32 [:func:`output_length`] at ``rate_out`` (``x`` as float32 when the rates
    are equal)."""
    x = np.asarray(x, np.float32).reshape(-1)
    if rate_in == rate_out:
        return x
    f = design(rate_in, rate_out)
    up, down, taps = f.up, f.down, f.taps
    n_out = output_length(x.size, rate_in, rate_out)
    # output k = g * up + r reads the window xp[g * down + s_r : + taps] of the zero-padded input with phase p_r
    newest = ((n_out - 1) * down + f.half) // up  # the last input position any output reads
    xp = np.zeros(taps - 1 + max(newest + 1, x.size), np.float32)
    xp[taps - 1:taps - 1 + x.size] = x
    windows = np.lib.stride_tricks.sliding_window_view(xp, taps)  # [len - taps + 1, taps], no copy
    y = np.empty(n_out, np.float32)
    for r in range(min(up, n_out)):
        s_r, p_r = divmod(r * down + f.half, up)
        rows = windows[s_r::down][: -(-(n_out - r) // up)]  # [G_r, taps], a strided view
        y[r::up] = np.einsum("gt,t->g", rows, f.phases[p_r])  # reads the view in place (no [G_r, taps] copy)
    return y
