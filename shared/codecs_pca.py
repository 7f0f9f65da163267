"""Calibrated transform codecs: the bundle's PCA basis, one uniform step, Rice-coded integers.

A transform coder in the textbook sense (Goyal, "Theoretical foundations of transform coding", 2001): the
boundary row ``x`` [H] is centred and projected on the leading ``r`` principal components of calibration
boundary states, ``c = (x - mean) @ basis[:, :r]``; every coefficient is quantized with one uniform step
(``q = rint(c / step)``; one step for all components is the mean-squared-error optimum at high rate, and a
component whose spread is below half a step costs more bits than it saves, so it is not sent: reverse
water-filling); the integers are Rice-coded with a per-component parameter ``k`` from calibration, so the
leading components get more bits and the tail none. The massive-activation channels need no special case:
they sit in the mean and in the leading components. Decoded: ``x = (q * step) @ basis[:, :r].T + mean``.

* ``pca-fine``    - the near-lossless level (step chosen at calibration for ~0.75 bytes per element).
* ``pca-compact`` - the compact level (~0.28 bytes per element).

The same artifact can carry entropy-coded levels (``pca-ans-compact``: :mod:`shared.codecs_pca_ans`), which
:class:`PcaBasis` stores and hashes alongside.

Both levels come from one calibration artifact (:class:`PcaBasis`, ``codec_pca.npz`` in the bundle,
written by ``partition_tools.codec_calibration``); both ends load it and check its sha256 against
``calibration.json``. Every payload starts with the first 4 bytes of the artifact's content digest, so a
tensor coded with another basis is refused (``bad_codec``) instead of decoding to garbage.

A row whose coefficients the Rice code cannot carry (a quotient above :data:`U_MAX`: an attention sink, a
token far outside the calibration) travels whole in float16, flagged in a row bitmap as in the outlier
codecs. Rows are coded independently: a prefill chunk and the same rows as decode steps decode identically.
Payload layout: docs/protocol.md, "Codec payloads". Quality: docs/quality.md, "Boundary codecs".
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .codec_base import pack_rows_bitmap, to_f16, unpack_rows_bitmap
from .codec_pca_base import FINGERPRINT_BYTES, BasisCodec
from .codecs_pca_ans import ANS_LEVELS, AnsFit, AnsLevel, fit_ans_level
from .codecs_pca_tcq import TCQ_LEVELS, TcqFit, TcqLevel, fit_tcq_level
from .errors import BAD_CODEC, BAD_TENSOR, ProtocolError
from .tensors import PayloadReader

LEVELS = ("pca-fine", "pca-compact")
U_MAX = 64  # largest Rice quotient; a row needing more goes whole in float16
K_MAX = 15  # largest Rice parameter
ARTIFACT_VERSION = 2  # 2: may carry entropy-coded levels (shared.codecs_pca_ans); version 1 artifacts still load


class CodecArtifactError(ValueError):
    """The codec calibration artifact is missing, malformed or not the one the bundle names."""


@dataclass(frozen=True)
class PcaLevel:
    step: float  # quantization step of every coefficient
    rice_k: np.ndarray  # uint8 [r]: Rice parameter of the leading r components (the rest are not sent)

    @property
    def r(self) -> int:
        return int(self.rice_k.size)


class PcaBasis:
    """The calibration artifact: ``mean`` [H], orthonormal ``basis`` [H, H] (columns = components by
    decreasing variance) and the coding levels. ``digest`` names its content (sha256 over the arrays)."""

    def __init__(self, mean: np.ndarray, basis: np.ndarray, levels: dict[str, PcaLevel]):
        mean = np.ascontiguousarray(mean, np.float32)
        basis = np.ascontiguousarray(basis, np.float32)
        h = mean.shape[0] if mean.ndim == 1 else -1
        if h < 1 or basis.shape != (h, h):
            raise CodecArtifactError(f"pca basis: mean [H] and basis [H, H] expected, got {mean.shape}, {basis.shape}")
        if not (np.isfinite(mean).all() and np.isfinite(basis).all()):
            raise CodecArtifactError("pca basis: NaN or Inf in the artifact")
        for name, lv in levels.items():
            if (name in ANS_LEVELS and isinstance(lv, AnsLevel)) or (name in TCQ_LEVELS and isinstance(lv, TcqLevel)):
                if lv.r > h:
                    raise CodecArtifactError(f"pca basis: level {name} sends {lv.r} of {h} components")
                continue
            if name not in LEVELS or not isinstance(lv, PcaLevel):
                raise CodecArtifactError(f"pca basis: unknown level {name!r} (known: "
                                         f"{', '.join(LEVELS + ANS_LEVELS + TCQ_LEVELS)})")
            k = lv.rice_k
            if (k.dtype != np.uint8 or k.ndim != 1 or not 1 <= k.size <= h or int(k.max()) > K_MAX
                    or not (np.isfinite(lv.step) and lv.step > 0)):
                raise CodecArtifactError(f"pca basis: level {name}: need a step > 0 and 1..{h} Rice parameters "
                                         f"in 0..{K_MAX}")
        self.mean, self.basis, self.levels = mean, basis, dict(levels)
        d = hashlib.sha256(b"autoglm-codec-pca\0" + mean.tobytes() + basis.tobytes())
        for name in sorted(levels):
            lv = levels[name]
            d.update(name.encode() + (lv.digest_bytes() if isinstance(lv, (AnsLevel, TcqLevel))
                                      else np.float64(lv.step).tobytes() + lv.rice_k.tobytes()))
        self.digest = d.hexdigest()

    @property
    def hidden_size(self) -> int:
        return int(self.mean.shape[0])

    # -- io -------------------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        arrays = {"version": np.array([ARTIFACT_VERSION], np.int32), "mean": self.mean, "basis": self.basis}
        for name, lv in self.levels.items():
            if isinstance(lv, (AnsLevel, TcqLevel)):
                arrays.update({f"{name}.{key}": v for key, v in lv.arrays().items()})
                continue
            arrays[f"{name}.step"] = np.array([lv.step], np.float64)
            arrays[f"{name}.rice_k"] = lv.rice_k
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> PcaBasis:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except Exception as e:  # noqa: BLE001 - zip / npy format errors of every kind
            raise CodecArtifactError(f"pca basis: not a codec artifact ({type(e).__name__}: {e})") from None
        try:
            return cls._from_arrays(arrays)
        except CodecArtifactError:
            raise
        except (KeyError, ValueError, TypeError, IndexError) as e:  # an array of the wrong kind or shape
            raise CodecArtifactError(f"pca basis: malformed artifact ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_arrays(cls, arrays: dict[str, np.ndarray]) -> PcaBasis:
        if arrays.get("version", np.zeros(1)).tolist() not in ([1], [ARTIFACT_VERSION]) or "mean" not in arrays \
                or "basis" not in arrays:
            raise CodecArtifactError(f"pca basis: expected artifact version 1..{ARTIFACT_VERSION} with mean and basis")
        levels = {}
        for name in LEVELS:
            if f"{name}.step" in arrays:
                step = arrays[f"{name}.step"]
                if step.shape != (1,) or f"{name}.rice_k" not in arrays:
                    raise CodecArtifactError(f"pca basis: level {name} is incomplete")
                levels[name] = PcaLevel(float(step[0]), arrays[f"{name}.rice_k"])
        for name, kind in [(n, AnsLevel) for n in ANS_LEVELS] + [(n, TcqLevel) for n in TCQ_LEVELS]:
            if f"{name}.step" in arrays:
                try:
                    levels[name] = kind.from_arrays({key: arrays[f"{name}.{key}"] for key in kind.FIELDS})
                except (KeyError, ValueError, IndexError) as e:
                    raise CodecArtifactError(f"pca basis: level {name}: {type(e).__name__}: {e}") from None
        return cls(arrays["mean"], arrays["basis"], levels)

    @classmethod
    def load(cls, path: str | Path, sha256: str | None = None) -> PcaBasis:
        """Read ``path``; with ``sha256`` (from calibration.json) the file must hash to it."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise CodecArtifactError(f"{path}: {e.strerror or e}") from None
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise CodecArtifactError(f"{path}: sha256 differs from the one calibration.json records")
        return cls.from_bytes(data)


# -- bit fields -------------------------------------------------------------------------------------------------

def _pack(bits: np.ndarray) -> bytes:
    return np.packbits(bits.astype(np.uint8), bitorder="little").tobytes()


def _unpack(rd: PayloadReader, nbits: int, what: str) -> np.ndarray:
    """``nbits`` bits (LSB first) from ``ceil(nbits / 8)`` payload bytes; padding bits must be zero."""
    raw = rd.take("uint8", ((nbits + 7) // 8,))
    bits = np.unpackbits(raw, bitorder="little")
    if bits[nbits:].any():
        raise ProtocolError(BAD_TENSOR, f"{what}: nonzero padding bits")
    return bits[:nbits]


class PcaCodec(BasisCodec):
    """One level of :class:`PcaBasis` (``pca-fine`` or ``pca-compact``)."""

    def __init__(self, basis: PcaBasis, level: str):
        if not isinstance(basis, PcaBasis):
            raise ProtocolError(BAD_CODEC, f"{level}: needs the bundle's PcaBasis (codec_pca.npz)")
        if level not in basis.levels:
            raise ProtocolError(BAD_CODEC, f"{level}: the bundle's codec artifact has no such level "
                                           f"(has: {', '.join(sorted(basis.levels))})")
        lv = basis.levels[level]
        super().__init__(basis, level, lv.step, lv.r)
        self.k = lv.rice_k.astype(np.int64)  # k [r]
        kk = self.k[self.k > 0]
        self._rem_comp = np.repeat(np.flatnonzero(self.k > 0), kk)  # [K]: component of each remainder bit
        self._rem_bit = np.concatenate([np.arange(k) for k in kk]) if kk.size else np.zeros(0, np.int64)  # [K]
        self._rem_starts = np.concatenate([[0], np.cumsum(kk)[:-1]]).astype(np.int64)  # first bit per component
        self._rem_bits = int(kk.sum())  # K: remainder bits per row

    # -- payload: fingerprint | bitmap | sink rows f16 | i32 unary bytes | unary | remainders | signs ------
    def encode_payload(self, x):
        s, h = x.shape
        c = (x - self.mean) @ self.analysis  # [S, r] float64
        q = np.rint(c / self.step).astype(np.int64)  # [S, r]
        m = np.abs(q)
        u = m >> self.k
        sink = (u > U_MAX).any(axis=1) if q.size else np.zeros(s, bool)  # [S]
        if sink.any():
            q, m, u = q[~sink], m[~sink], u[~sink]
        parts = [self.fingerprint, pack_rows_bitmap(sink), to_f16(x[sink], f"{self.name} sink rows").tobytes()]
        ends = np.cumsum(u.ravel() + 1) - 1  # the terminating 1 of each coefficient's unary code
        unary = np.zeros(int(ends[-1]) + 1 if ends.size else 0, np.uint8)
        unary[ends] = 1
        unary_bytes = _pack(unary)
        rem = m & ((1 << self.k) - 1)  # [S_q, r]
        rem_bits = (rem[:, self._rem_comp] >> self._rem_bit) & 1  # [S_q, K]
        parts += [np.int32(len(unary_bytes)).astype("<i4").tobytes(), unary_bytes, _pack(rem_bits.ravel()),
                  _pack(q[m > 0] < 0)]
        return b"".join(parts)

    def decode_payload(self, payload, s, h):
        rd = PayloadReader(payload, self.name)
        self.read_fingerprint(rd)
        sink = unpack_rows_bitmap(rd.take("uint8", ((s + 7) // 8,)), s, self.name)  # [S]
        n_sink = int(sink.sum())
        sinks = rd.take("float16", (n_sink, h), finite=True)
        sq, r = s - n_sink, self.r
        n_unary = int(rd.take("int32", (1,))[0])
        if not 0 <= n_unary <= len(payload):
            raise ProtocolError(BAD_TENSOR, f"{self.name}: unary field of {n_unary} bytes in a shorter payload")
        ones = np.flatnonzero(np.unpackbits(rd.take("uint8", (n_unary,)), bitorder="little"))
        if ones.size != sq * r or (ones.size and n_unary != int(ones[-1]) // 8 + 1) or (not ones.size and n_unary):
            raise ProtocolError(BAD_TENSOR, f"{self.name}: unary field holds {ones.size} codes in {n_unary} bytes, "
                                            f"expected {sq * r}")
        u = np.diff(ones, prepend=-1) - 1  # [S_q * r] quotients
        if u.size and int(u.max()) > U_MAX:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: Rice quotient above {U_MAX}")
        m = (u.reshape(sq, r) << self.k)  # [S_q, r]
        if self._rem_bits:
            bits = _unpack(rd, sq * self._rem_bits, self.name).reshape(sq, self._rem_bits).astype(np.int64)
            if sq:
                m[:, self.k > 0] += np.add.reduceat(bits << self._rem_bit, self._rem_starts, axis=1)
        else:
            _unpack(rd, 0, self.name)
        nz = m > 0
        neg = _unpack(rd, int(nz.sum()), self.name).astype(bool)
        rd.finish()
        coef = m.astype(np.float64)  # [S_q, r]
        coef[nz] = np.where(neg, -coef[nz], coef[nz])
        return self.synthesize(coef * self.step, sink, sinks)

    def max_payload_bytes(self, s, h):
        coded = 4 + (s * self.r * (U_MAX + 1) + 7) // 8 + (s * self._rem_bits + 7) // 8 + (s * self.r + 7) // 8
        return FINGERPRINT_BYTES + (s + 7) // 8 + max(2 * s * h + 4 + 2, coded)

    def payload_bytes(self, s, h):
        """Not fixed: the Rice code's length depends on the values. This is the bound (:meth:`max_payload_bytes`)."""
        return self.max_payload_bytes(s, h)


# -- calibration (pure numpy; partition_tools.codec_calibration calls it) ---------------------------------------

def rice_bits(m: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Bits of each magnitude ``m`` (int) under Rice parameter ``k``: unary quotient + 1, k bits, a sign if > 0."""
    return (m >> k) + 1 + k + (m > 0)


def fit_level(coef: np.ndarray, step: float, drop: float = 0.5) -> tuple[PcaLevel, float]:
    """The level for calibration coefficients ``coef`` [T, H] (ordered by variance) at ``step``: components
    whose standard deviation is below ``drop`` x step are not sent; each sent one gets the Rice parameter
    that minimizes its bits. Returns the level and its mean bits per hidden element on ``coef``."""
    t, h = coef.shape
    sd = coef.std(axis=0)
    r = max(1, int(np.count_nonzero(sd >= drop * step)))
    m = np.abs(np.rint(coef[:, :r] / step)).astype(np.int64)  # [T, r]
    cost = np.stack([rice_bits(m, np.int64(k)).mean(axis=0) for k in range(K_MAX + 1)])  # [K_MAX+1, r]
    k = cost.argmin(axis=0).astype(np.uint8)
    return PcaLevel(float(step), k), float(cost.min(axis=0).sum() / h)


def calibrate_pca(hidden: np.ndarray, targets: dict[str, float], sink_factor: float = 4.0,
                  ans: AnsFit | None = None, tcq: TcqFit | None = None) -> PcaBasis:
    """A :class:`PcaBasis` from calibration boundary states ``hidden`` [T, H], with one level per entry of
    ``targets`` (level name -> bytes per element of the coded coefficients on this calibration, reached by
    bisection on the step). Rows with a norm above ``sink_factor`` x the median (attention sinks) are left out
    of the statistics; they travel as float16 sink rows anyway."""
    x = np.asarray(hidden, np.float64)
    if x.ndim != 2 or x.shape[0] < 2 or not np.isfinite(x).all():
        raise ValueError(f"calibration hidden states: expected finite [T, H] with T >= 2, got {x.shape}")
    norms = np.linalg.norm(x, axis=1)
    x = x[norms <= sink_factor * np.median(norms)]
    mean, basis = _principal_components(x)
    coef = ((x - mean) @ basis).astype(np.float64)  # [T, H]
    ans = ans or AnsFit()
    held = ans.folds > 1 and any(n in ANS_LEVELS + TCQ_LEVELS for n in targets)
    sd = heldout_sd(x, ans.folds) if held else None
    return PcaBasis(mean.astype(np.float32), basis, fit_levels(coef, targets, ans, sd, tcq))


def _principal_components(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean [H] and orthonormal components [H, H] (float32, by decreasing variance) of rows ``x`` [T, H]."""
    mean = x.mean(axis=0)
    _, v = np.linalg.eigh(np.cov((x - mean).T).reshape(x.shape[1], x.shape[1]))
    return mean, v[:, ::-1].astype(np.float32)


def heldout_sd(x: np.ndarray, folds: int) -> np.ndarray:
    """Standard deviation [H] of each principal component (by rank) on rows the basis did not see: the rows
    ``x`` [T, H] cut into ``folds`` contiguous parts, each projected on the components of the others. A
    sample covariance of a few thousand rows puts too little variance in its tail components (held-out
    text has 2-4x more there, docs/quality.md), which would make the rANS tables too narrow."""
    var = np.zeros(x.shape[1])
    for part in np.array_split(np.arange(x.shape[0]), folds):
        rest = np.setdiff1d(np.arange(x.shape[0]), part)
        mean, basis = _principal_components(x[rest])
        var += (((x[part] - mean) @ basis) ** 2).mean(axis=0) / folds
    return np.sqrt(var)


def fit_levels(coef: np.ndarray, targets: dict[str, float], ans: AnsFit | None = None,
               sd: np.ndarray | None = None, tcq: TcqFit | None = None) -> dict[str, PcaLevel | AnsLevel | TcqLevel]:
    """One level per target (level name -> bytes per element of ``coef`` [T, H]), the step found by
    bisection: a Rice level (:func:`fit_level`) for :data:`LEVELS`, an entropy-coded one
    (:func:`shared.codecs_pca_ans.fit_ans_level`, options ``ans``, component spreads ``sd`` [H], by default
    those of ``coef``) for :data:`ANS_LEVELS`, a trellis-coded one (:func:`shared.codecs_pca_tcq.fit_tcq_level`,
    options ``tcq``, the same spreads) for :data:`TCQ_LEVELS`."""
    levels = {}
    probe = coef[:: max(1, coef.shape[0] // 1024)]  # the bisection runs on <= ~1k rows, the final fit on all
    sd = coef.std(axis=0) if sd is None else sd  # [H]
    for name, target in targets.items():
        if name in ANS_LEVELS:
            def fit(c, step):
                return fit_ans_level(c, sd, step, ans or AnsFit())
        elif name in TCQ_LEVELS:
            def fit(c, step):
                return fit_tcq_level(c, sd, step, tcq or TcqFit())
        else:
            def fit(c, step):
                return fit_level(c, step)
        lo, hi = np.log(1e-4 * coef.std() + 1e-12), np.log(4 * np.abs(coef).max() + 1e-12)
        for _ in range(30):  # bisection on log(step): bits decrease with the step
            mid = 0.5 * (lo + hi)
            _, bits = fit(probe, float(np.exp(mid)))
            lo, hi = (mid, hi) if bits > 8 * target else (lo, mid)
        levels[name] = fit(coef, float(np.exp(hi)))[0]
    return levels
