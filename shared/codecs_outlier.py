"""Outlier-aware boundary codecs: massive-activation channels and attention-sink rows in float16,
everything else in int8 (near-lossless) or rotated 4-bit (compact).

Why: a handful of hidden channels carry "massive activations" (Sun et al., 2024, arXiv:2402.17762) - in
SmolLM2-135M channel 507 reaches ~800 after layer 4 and ~20,000 after layer 16 while the median channel
stays below 10 - and the first token is an attention sink with a huge norm (Xiao et al., 2023,
arXiv:2309.17453). Any shared scale that covers those values wastes the code range of every other
channel. The channels are fixed per model and split layer, so they are found once at partition time from
calibration text (:func:`find_outlier_channels`) and stored in the bundle; both ends build the same codec
from the bundle, and none of it travels per message.

``int8-outlier``: outlier channels float16; per row one float16 scale (absmax/127) and int8 codes for the
other channels. ~1.02 bytes/element for H=576, k=8.

``int4-outlier``: outlier channels float16; the other channels in blocks of 16, each block rotated by a
sign-flipped 16x16 Hadamard matrix (QuaRot, Ashkboos et al., 2024, arXiv:2404.00456: rotation spreads a
block's energy evenly so absmax scaling wastes fewer codes), then quantized to 16 midrise levels
``(c - 7.5) * scale / 8`` with a per-block scale stored as one byte ``e`` (``scale = ref * 2**(-e/16)``,
``ref`` = the row's float32 absmax after rotation, ``e`` rounded down so nothing clips). Midrise levels use all 16 codes; the
byte scales cost half of float16 scales, which pays for blocks of 16. ~0.59 bytes/element for H=576, k=8.
(Tried and measured, docs/quality.md: per-channel pre-scaling from calibration statistics or from a
diagonal Fisher estimate, NF4 levels, MSE-searched clipping, 32/64-wide rotations - none beat this.)

Rows whose largest non-outlier magnitude exceeds ``sink_threshold`` (from calibration,
:func:`find_sink_threshold`) travel entirely in float16: a few per prompt, so they cost nothing in bytes.

Payload layouts: docs/protocol.md, "Codec payloads".
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .codec_base import (
    BoundaryCodec,
    check_scales,
    f16_round_up,
    pack_nibbles,
    pack_rows_bitmap,
    to_f16,
    unpack_nibbles,
    unpack_rows_bitmap,
)
from .errors import BAD_CODEC, BAD_TENSOR, ProtocolError
from .tensors import PayloadReader, check_finite
from .wire import DEFAULT_LIMITS

MAX_OUTLIER_CHANNELS = 256
ROT = 16  # rotation and scale block of int4-outlier
SIGN_PATTERN = 0x79B9  # bit i set -> sign +1 for element i of every rotated block (a fixed, documented mask
#                        so another implementation needs no random-number generator; 0x79B9 = low 16 bits of
#                        the golden-ratio constant 0x9E3779B9)
LOG_STEPS = 16  # scale exponent resolution: 16 steps per octave (4.4 % apart)
REF_MAX = 2.0 ** 126  # largest int4-outlier row ref: decoded values stay within 3.75 x ref, below float32's max


@cache
def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (symmetric, its own inverse)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    m = np.ones((1, 1), np.float64)
    while m.shape[0] < n:
        m = np.block([[m, m], [m, -m]])
    return (m / np.sqrt(n)).astype(np.float32)


def rotation_signs(n: int = ROT) -> np.ndarray:
    return np.array([1.0 if (SIGN_PATTERN >> i) & 1 else -1.0 for i in range(n)], np.float32)


_SIGNS = rotation_signs()
_SCALE_TABLE = np.exp2(-np.arange(256, dtype=np.float64) / LOG_STEPS).astype(np.float32)  # [256]


def _rotate(r: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate every full block of 16 columns of r [S, n] (the ragged tail stays as it is)."""
    s, n = r.shape
    nf = n // ROT * ROT
    out = r.copy()
    if nf:
        blocks = r[:, :nf].reshape(s, nf // ROT, ROT)
        hm = hadamard(ROT)
        y = (blocks @ hm) * _SIGNS if inverse else (blocks * _SIGNS) @ hm
        out[:, :nf] = y.reshape(s, nf)
    return out


class OutlierCodec(BoundaryCodec):
    """Common part: the row bitmap, float16 sink rows, float16 outlier channels. Subclasses code the rest."""

    def __init__(self, outlier_channels, sink_threshold: float | None = None):
        try:
            given = list(outlier_channels)
            ch = sorted({int(c) for c in given})
            integral = all(int(c) == c and not isinstance(c, bool) for c in given)
        except (TypeError, ValueError, OverflowError):
            raise ProtocolError(BAD_CODEC, f"{self.name}: outlier_channels must be integers") from None
        if not integral or len(ch) != len(given) or not ch or ch[0] < 0 or len(ch) > MAX_OUTLIER_CHANNELS:
            raise ProtocolError(BAD_CODEC, f"{self.name}: outlier_channels must be 1..{MAX_OUTLIER_CHANNELS} "
                                           "distinct non-negative channel indices")
        if sink_threshold is not None:
            try:
                sink_threshold = float(sink_threshold)
            except (TypeError, ValueError):
                sink_threshold = float("nan")
            if not (np.isfinite(sink_threshold) and sink_threshold > 0):
                raise ProtocolError(BAD_CODEC, f"{self.name}: sink_threshold must be a positive number or None")
        self.outlier_channels = ch
        self.sink_threshold = None if sink_threshold is None else float(sink_threshold)
        self._run_cache: dict[int, tuple[tuple[int, int, int], ...]] = {}  # h -> runs (:meth:`_runs`)

    def check_hidden_size(self, h):
        if self.outlier_channels[-1] >= h or len(self.outlier_channels) >= h:
            raise ProtocolError(BAD_CODEC, f"{self.name}: outlier channels {self.outlier_channels[-3:]}... do "
                                           f"not fit hidden size {h} (codec built for another model?)")

    def _runs(self, h: int) -> tuple[tuple[int, int, int], ...]:
        """The non-outlier channels as contiguous runs ``(start, stop, offset)``: channels ``[start, stop)`` of
        the hidden state are columns ``[offset, offset + stop - start)`` of the packed rest [S, H - k].

        Copying these slices moves the same values as a fancy-index gather/scatter over the rest's indices,
        without an index array per element (90x faster for 512x4096: the outliers are sorted, so there are at
        most k + 1 runs)."""
        if h not in self._run_cache:
            runs, lo, off = [], 0, 0
            for c in [*self.outlier_channels, h]:
                if c > lo:
                    runs.append((lo, c, off))
                    off += c - lo
                lo = c + 1
            self._run_cache[h] = tuple(runs)
        return self._run_cache[h]

    def _gather_rest(self, x: np.ndarray) -> np.ndarray:
        """The non-outlier channels of ``x`` [S, H], packed in ascending order [S, H - k]."""
        s, h = x.shape
        r = np.empty((s, h - len(self.outlier_channels)), x.dtype)
        for lo, hi, off in self._runs(h):
            r[:, off:off + hi - lo] = x[:, lo:hi]
        return r

    def _scatter_rest(self, out: np.ndarray, r: np.ndarray) -> None:
        """Write the packed rest ``r`` [S, H - k] into the non-outlier channels of ``out`` [S, H]."""
        for lo, hi, off in self._runs(out.shape[1]):
            out[:, lo:hi] = r[:, off:off + hi - lo]

    # -- payload: bitmap | sink rows f16 [S_s, H] | outliers f16 [S_q, k] | rest (subclass) ------------
    def encode_payload(self, x):
        s, h = x.shape
        r = self._gather_rest(x)  # [S, n]
        if self.sink_threshold is not None and r.size:
            sink = np.abs(r).max(axis=1) > self.sink_threshold  # [S]
        else:
            sink = np.zeros(s, bool)
        any_sink = bool(sink.any())
        keep = ~sink
        xq, rq = (x[keep], r[keep]) if any_sink else (x, r)  # [S_q, H], [S_q, n]
        parts = [pack_rows_bitmap(sink), to_f16(x[sink], f"{self.name} sink rows").tobytes(),
                 to_f16(xq[:, self.outlier_channels], f"{self.name} outlier channels").tobytes()]
        parts.append(self.encode_rest(rq))
        return b"".join(parts)

    def decode_payload(self, payload, s, h):
        rd = PayloadReader(payload, self.name)
        sink = unpack_rows_bitmap(rd.take("uint8", ((s + 7) // 8,)), s, self.name)  # [S]
        n_sink = int(sink.sum())
        sinks = rd.take("float16", (n_sink, h), finite=True)
        k, n = len(self.outlier_channels), h - len(self.outlier_channels)
        outl = rd.take("float16", (s - n_sink, k), finite=True)
        r = self.decode_rest(rd, s - n_sink, n)  # [S_q, n]
        rd.finish()
        out = np.empty((s, h), np.float32)
        q = np.empty((s - n_sink, h), np.float32) if n_sink else out  # [S_q, H]: no sink rows, decode in place
        q[:, self.outlier_channels] = outl
        self._scatter_rest(q, r)
        if n_sink:
            out[sink] = sinks
            out[~sink] = q
        return out

    def decode_rows(self, tensors, limits=None):
        """One pass for N one-row tensors without sink rows: their payloads are cut into fields and laid out
        as the payload of one [N, H] tensor (bitmap | outliers [N, k] | rest fields [N, w] ...), which
        :meth:`decode_payload` validates and decodes as usual. Anything else (a sink row, zstd, another
        shape or length) goes through the default path, one tensor at a time."""
        rows = self._plain_rows(tensors, limits)
        if rows is None:
            return super().decode_rows(tensors, limits)
        b, h = len(tensors), tensors[0].shape[1]
        k, n = len(self.outlier_channels), h - len(self.outlier_channels)
        per_row = rows.shape[1]
        joined = np.zeros(b * per_row - b + (b + 7) // 8, np.uint8)  # the [N, H] payload; its bitmap stays 0
        at, dst = 1, (b + 7) // 8
        for width in (2 * k, *self.rest_fields(n)):
            joined[dst:dst + b * width].reshape(b, width)[:] = rows[:, at:at + width]  # field [N, width]
            at, dst = at + width, dst + b * width
        try:
            return self.decode_payload(joined, b, h)
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - as in decode(): a layout bug must not crash a server
            raise ProtocolError(BAD_TENSOR, f"{self.name}: undecodable payload ({type(e).__name__}: {e})") from None

    def _plain_rows(self, tensors, limits) -> np.ndarray | None:
        """The payloads of N one-row tensors without a sink row as one uint8 array [N, payload bytes], or None
        where one is not such a tensor (a sink row, zstd, another shape or length, padding bits set: the
        one-by-one path decodes or refuses it)."""
        h = tensors[0].shape[1] if tensors else 0
        if (not tensors or h <= len(self.outlier_channels)
                or any(t.codec != self.name or t.shape != (1, h) or t.zstd for t in tensors)):
            return None
        self.check_shape(1, h, limits or DEFAULT_LIMITS)
        per_row = self.payload_bytes(1, h)
        if any(len(t.data) != per_row for t in tensors):
            return None
        rows = np.frombuffer(b"".join(t.data for t in tensors), np.uint8).reshape(len(tensors), per_row)
        return None if rows[:, 0].any() else rows

    def payload_bytes(self, s, h):
        k = len(self.outlier_channels)
        return (s + 7) // 8 + 2 * s * k + self.rest_bytes(s, h - k)

    def max_payload_bytes(self, s, h):
        k = len(self.outlier_channels)
        return (s + 7) // 8 + max(2 * s * h, 2 * s * k + self.rest_bytes(s, h - k))

    def encode_rest(self, r: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode_rest(self, rd: PayloadReader, s: int, n: int) -> np.ndarray:
        raise NotImplementedError

    def rest_fields(self, n: int) -> tuple[int, ...]:
        """Bytes per row of each field of the rest, in payload order (each field is [S_q, width])."""
        raise NotImplementedError

    def rest_bytes(self, s: int, n: int) -> int:
        return s * sum(self.rest_fields(n))


class OutlierInt8Codec(OutlierCodec):
    """rest: row scales f16 [S_q] | codes int8 [S_q, n] in -127..127."""

    name = "int8-outlier"

    def encode_rest(self, r):
        scale = f16_round_up(np.abs(r).max(axis=1, initial=0.0) / 127)  # [S_q]
        if not np.isfinite(scale).all():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: row scale beyond the float16 range")
        sf = scale.astype(np.float32)[:, None]
        q = np.where(sf > 0, np.rint(r / np.where(sf > 0, sf, 1)), 0)
        return scale.tobytes() + np.clip(q, -127, 127).astype(np.int8).tobytes()

    def decode_rest(self, rd, s, n):
        scale = rd.take("float16", (s,)).astype(np.float32)
        check_scales(scale, self.name)
        q = rd.take("int8", (s, n))
        if q.size and q.min() == -128:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: code -128 is not used")
        r = q.astype(np.float32)  # in place from here: a second temporary this size costs page faults
        r *= scale[:, None]
        return r

    def rest_fields(self, n):
        return (2, n)

    def decode_rows(self, tensors, limits=None):
        """:meth:`OutlierCodec.decode_rows` without laying the rows out as one payload: each field is read in
        place from the rows (outliers [N, k], scales [N], codes [N, n]), checked as :meth:`decode_payload`
        checks it, and the codes are scaled straight into the output's channel runs (one pass)."""
        rows = self._plain_rows(tensors, limits)
        if rows is None:
            return super().decode_rows(tensors, limits)
        b, h = len(tensors), tensors[0].shape[1]
        k = len(self.outlier_channels)
        try:
            outl = np.ascontiguousarray(rows[:, 1:1 + 2 * k]).view("<f2")  # [N, k]
            check_finite(outl, f"{self.name} float16[{b}, {k}]")
            scale = np.ascontiguousarray(rows[:, 1 + 2 * k:3 + 2 * k]).view("<f2").astype(np.float32)  # [N, 1]
            check_scales(scale, self.name)
            codes = rows[:, 3 + 2 * k:].view(np.int8)  # [N, n]
            if codes.min() == -128:
                raise ProtocolError(BAD_TENSOR, f"{self.name}: code -128 is not used")
            out = np.empty((b, h), np.float32)
            for lo, hi, off in self._runs(h):
                np.multiply(codes[:, off:off + hi - lo], scale, out=out[:, lo:hi])
            out[:, self.outlier_channels] = outl
            return out
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - as in decode(): a layout bug must not crash a server
            raise ProtocolError(BAD_TENSOR, f"{self.name}: undecodable payload ({type(e).__name__}: {e})") from None


class OutlierInt4Codec(OutlierCodec):
    """rest: row refs f32 [S_q] | block exponents uint8 [S_q, nb] | codes uint8 [S_q, ceil(n/2)]."""

    name = "int4-outlier"

    def encode_rest(self, r):
        s, n = r.shape
        nb = -(-n // ROT)
        with np.errstate(over="ignore", invalid="ignore"):  # values that overflow are refused below (REF_MAX)
            z = _rotate(r)  # [S_q, n]
        if nb * ROT != n:
            z = np.concatenate([z, np.zeros((s, nb * ROT - n), np.float32)], axis=1)
        zb = z.reshape(s, nb, ROT)
        amax = np.abs(zb).max(axis=-1)  # [S_q, nb]
        ref = amax.max(axis=1, initial=0.0).astype("<f4")  # [S_q] float32 (rotation can grow values 4x)
        if not (ref <= REF_MAX).all():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: values beyond its range (rotated row absmax over "
                                            "2^126); use bf16")
        reff = ref[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.floor(-LOG_STEPS * np.log2(amax / reff))  # largest e with ref * 2**(-e/16) >= amax
        e = np.where(amax > 0, np.clip(np.nan_to_num(e, nan=255.0, posinf=255.0), 0, 255), 255).astype(np.uint8)
        step = (reff * _SCALE_TABLE[e] / 8)[..., None]  # [S_q, nb, 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            c = np.where(step > 0, np.floor(zb / np.where(step > 0, step, 1)) + 8, 8)
        c = np.clip(c, 0, 15).astype(np.uint8).reshape(s, nb * ROT)[:, :n]
        return ref.tobytes() + e.tobytes() + pack_nibbles(c).tobytes()

    def decode_rest(self, rd, s, n):
        nb = -(-n // ROT)
        ref = rd.take("float32", (s,))
        check_scales(ref, self.name)
        if ref.size and ref.max() > REF_MAX:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: a row ref over 2^126 (its values would overflow float32)")
        e = rd.take("uint8", (s, nb))
        c = unpack_nibbles(rd.take("uint8", (s, (n + 1) // 2)), n, self.name)  # [S_q, n]
        step = ref[:, None] * _SCALE_TABLE[e] / 8  # [S_q, nb]
        z = (c.astype(np.float32) - 7.5) * np.repeat(step, ROT, axis=1)[:, :n]
        return _rotate(z, inverse=True)

    def rest_fields(self, n):
        return (4, -(-n // ROT), (n + 1) // 2)


# -- calibration helpers (pure numpy; the partition tool calls these) -------------------------------------------

def _sink_rows(hidden: np.ndarray, factor: float) -> np.ndarray:
    norms = np.linalg.norm(hidden, axis=1)  # [T]
    return norms > factor * np.median(norms)


def find_outlier_channels(hidden: np.ndarray, k: int = 8, sink_factor: float = 4.0) -> list[int]:
    """The ``k`` channels of largest magnitude in calibration hidden states ``hidden`` [T, H].

    Rows with a norm above ``sink_factor`` x the median (attention sinks, sent whole in float16) are left out
    of the statistic, so a channel counts as an outlier only if it is large on ordinary tokens. Returns
    ascending channel indices.
    """
    hidden = np.asarray(hidden, np.float32)
    if hidden.ndim != 2 or hidden.shape[0] < 1 or not np.isfinite(hidden).all():
        raise ValueError(f"calibration hidden states: expected finite [T, H], got shape {hidden.shape}")
    if not 1 <= k < hidden.shape[1]:
        raise ValueError(f"k must be in [1, {hidden.shape[1] - 1}], got {k}")
    ordinary = ~_sink_rows(hidden, sink_factor)
    rows = hidden[ordinary] if ordinary.any() else hidden
    score = np.abs(rows).max(axis=0)  # [H]
    return sorted(int(c) for c in np.argsort(-score, kind="stable")[:k])


def find_sink_threshold(hidden: np.ndarray, outlier_channels, factor: float = 8.0) -> float:
    """Rows whose non-outlier absmax exceeds the returned value are coded as float16 sink rows.

    ``factor`` x the median row absmax over the non-outlier channels of calibration ``hidden`` [T, H]. In
    SmolLM2 the first token after layer 16 sits at ~17x the median; ordinary tokens stay under ~2.5x.
    """
    hidden = np.asarray(hidden, np.float32)
    keep = np.ones(hidden.shape[1], bool)
    keep[list(outlier_channels)] = False
    row_max = np.abs(hidden[:, keep]).max(axis=1)
    return float(factor * max(np.median(row_max), 1e-6))
