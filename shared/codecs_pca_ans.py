"""The PCA transform coder with a context-modelled entropy coder: ``pca-ans-compact``.

The transform is that of :mod:`shared.codecs_pca` (the bundle's PCA basis and mean, one uniform step); what
differs is how the integers travel. Instead of a Rice code with one parameter per component, every
coefficient is coded with range ANS (:mod:`shared.rans`) under a distribution chosen by its component *and by
the row's scale*: the boundary rows of a transformer are a scale mixture (some tokens' states are larger
than others' in every component), so each row picks the nearest of ``C`` scale classes (its *row byte*),
and coefficient ``j`` of a row of class ``c`` is coded under the calibrated table ``table_of[c, j]``. A table
models ``q`` (in steps) as a discretised generalized Gaussian; large values are split as ``q = hi * 2**shift
+ lo`` (floor division), ``hi`` coded by the table and the ``shift`` low bits sent raw. A ``hi`` outside its
table is *escaped* (a rare symbol, then ``hi`` as int16; up to 6 per row, counted in the row byte); a row
with more escapes travels whole in float16. The decoder puts a nonzero ``q`` at the model's bin centroid,
``sign(q) * (|q| - shrink)`` steps.

The component spreads behind the tables are measured on held-out folds of the calibration
(:func:`shared.codecs_pca.heldout_sd`): held-out text has 2-4x the calibration's variance in the tail
components. The level lives in the bundle's PCA artifact (:class:`shared.codecs_pca.PcaBasis`), integer
tables included, so both ends code with bit-identical probabilities.
Payload layout: docs/protocol.md, "Codec payloads"; quality: docs/quality.md, "PCA codecs".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import rans
from .codec_base import to_f16
from .codec_pca_base import FINGERPRINT_BYTES, BasisCodec
from .errors import BAD_CODEC, BAD_TENSOR, ProtocolError
from .tensors import PayloadReader

ANS_LEVELS = ("pca-ans-compact",)
RAW_ROW = 255  # row byte of a row sent whole in float16
CLASS_BITS = 5  # row byte = class | escapes << CLASS_BITS
MAX_CLASSES = 1 << CLASS_BITS
ROW_ESCAPES_MAX = 6  # escapes a coded row may have (7 << CLASS_BITS marks a raw row); more: the row goes raw
ESCAPE = 0  # rANS symbol of a coefficient its table cannot code: its hi follows as int16
ESCAPE_BITS = 16
DECODE_BLOCK_ROWS = 256  # rows decoded at a time (bounds the decoder's int64 working arrays)
MAX_SHIFT = 12


@dataclass(frozen=True)
class AnsLevel:
    """One entropy-coded level: ``step``; the row classes' gains (log2, [C], used by the encoder to pick a
    row's class); ``table_of`` uint8 [C, r] (the table of component j in a row of class c); per table ``g``:
    ``freq`` [G, A] (rANS frequencies of ``hi + offset``), ``shift`` uint8 [G] and ``shrink`` float64 [G]."""

    step: float
    component_sd: np.ndarray  # float64 [r]: calibration standard deviation of each sent component, in steps
    class_log2_gain: np.ndarray  # float64 [C]
    table_of: np.ndarray  # uint8 [C, r]
    freq: np.ndarray  # uint16 [G, A]
    shift: np.ndarray  # uint8 [G]
    shrink: np.ndarray  # float64 [G]

    def __post_init__(self):
        c, r = self.table_of.shape if self.table_of.ndim == 2 else (0, 0)
        g = self.freq.shape[0] if self.freq.ndim == 2 else 0
        ok = (np.isfinite(self.step) and self.step > 0 and 1 <= c <= MAX_CLASSES and r >= 1 and g >= 1
              and self.table_of.dtype == np.uint8 and self.class_log2_gain.shape == (c,)
              and self.component_sd.shape == (r,) and np.isfinite(self.component_sd).all()
              and (self.component_sd > 0).all()
              and np.isfinite(self.class_log2_gain).all() and self.shift.shape == (g,) and self.shrink.shape == (g,)
              and self.shift.dtype == np.uint8 and self.freq.dtype == np.uint16 and int(self.table_of.max()) < g
              and int(self.shift.max()) <= MAX_SHIFT and np.isfinite(self.shrink).all()
              and ((self.shrink >= 0) & (self.shrink < 1)).all() and self.freq.shape[1] % 2 == 0
              and (self.freq[:, ESCAPE] > 0).all())
        if not ok:
            raise ValueError("ans level: malformed tables")
        if (self.freq.astype(np.int64).sum(axis=1) != rans.M).any():
            raise ValueError(f"ans level: every table's frequencies must sum to {rans.M}")

    @property
    def r(self) -> int:
        return int(self.table_of.shape[1])

    @property
    def offset(self) -> int:
        return self.freq.shape[1] // 2  # symbol = hi + offset

    # -- artifact io (keys under the level's name; shared.codecs_pca.PcaBasis stores them) ---------------------
    FIELDS = ("step", "component_sd", "class_log2_gain", "table_of", "freq", "shift", "shrink")

    def arrays(self) -> dict[str, np.ndarray]:
        return {"step": np.array([self.step], np.float64), "component_sd": self.component_sd,
                "class_log2_gain": self.class_log2_gain,
                "table_of": self.table_of, "freq": self.freq, "shift": self.shift, "shrink": self.shrink}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> AnsLevel:
        if a["step"].shape != (1,):
            raise ValueError("ans level: step must be one float64")
        return cls(float(a["step"][0]), a["component_sd"].astype(np.float64), a["class_log2_gain"].astype(np.float64),
                   a["table_of"], a["freq"], a["shift"], a["shrink"].astype(np.float64))

    def digest_bytes(self) -> bytes:
        return b"".join(np.ascontiguousarray(v).tobytes() for v in self.arrays().values())


class RansRowsCodec(BasisCodec):
    """The payload both rANS-coded PCA levels share (``pca-ans-compact``, ``pca-tcq-compact``): fingerprint |
    row bytes [S] | raw rows f16 | lo bits | escaped hi i16 | word counts [Sq - 1] u16 | rANS words. A subclass
    sets ``model`` (``classes``, ``lo_bits_of``) and ``max_words`` and decodes a block of coded rows
    (``_decode_block``); parsing and checking the layout is here, once. A subclass names the artifact level it
    reads (``level_type``) and its symbol model (``model_type``); the level's lookup is here too."""

    level_type: type
    model_type: type

    def __init__(self, basis, level: str):
        lv = getattr(basis, "levels", {}).get(level)
        if not isinstance(lv, self.level_type):
            raise ProtocolError(BAD_CODEC, f"{level}: the bundle's codec artifact has no such level")
        super().__init__(basis, level, lv.step, lv.r)
        self.level = lv
        self.model = self.model_type(lv)
        self.max_words = self.r + rans.STATE_WORDS  # at most one renormalisation word per coefficient

    def decode_payload(self, payload, s, h):
        rd = PayloadReader(payload, self.name)
        self.read_fingerprint(rd)
        row_byte = rd.take("uint8", (s,)).astype(np.int64)  # [S]
        raw = row_byte == RAW_ROW
        m = self.model
        cls, row_esc = row_byte[~raw] & (MAX_CLASSES - 1), row_byte[~raw] >> CLASS_BITS
        if (cls >= m.classes).any() or (row_esc > ROW_ESCAPES_MAX).any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: a row byte with a class above {m.classes - 1} or more "
                                            f"than {ROW_ESCAPES_MAX} escapes")
        n_raw, n_esc = int(raw.sum()), int(row_esc.sum())
        raws = rd.take("float16", (n_raw, h), finite=True)
        sq = cls.size
        lo_bits = m.lo_bits_of[cls]  # [Sq]
        n_lo = int(lo_bits.sum())
        lo_bytes = rd.take("uint8", ((n_lo + 7) // 8,))
        escapes = rd.take("int16", (n_esc,)).astype(np.int64)
        lengths = np.zeros(sq, np.int64)
        if sq:
            lengths[:-1] = rd.take("int16", (sq - 1,)).view("<u2")  # (the wire dtypes have no uint16)
        used = FINGERPRINT_BYTES + s + 2 * n_raw * h + lo_bytes.size + 2 * n_esc + 2 * max(sq - 1, 0)
        rest = len(payload) - used
        if rest % 2 or (sq == 0 and rest) or (sq and rest < 2 * rans.STATE_WORDS):
            raise ProtocolError(BAD_TENSOR, f"{self.name}: {rest} bytes of rANS words for {sq} coded rows")
        if sq:
            lengths[-1] = rest // 2 - int(lengths[:-1].sum())
        if ((lengths < rans.STATE_WORDS) | (lengths > self.max_words)).any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: a row's rANS stream length is out of range "
                                            f"[{rans.STATE_WORDS}, {self.max_words}] words")
        words = rd.take("int16", (rest // 2,)).view("<u2")
        rd.finish()
        bits = np.unpackbits(lo_bytes, bitorder="little")
        if bits[n_lo:].any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: nonzero padding bits")
        # rows in blocks: a few payload bytes per row decode to [r] int64 working arrays each
        ends = {"word": np.cumsum(lengths), "lo": np.cumsum(lo_bits), "esc": np.cumsum(row_esc)}
        coef = np.empty((sq, self.r), np.float64)  # [Sq, r]
        for b0 in range(0, sq, DECODE_BLOCK_ROWS):
            b1 = min(sq, b0 + DECODE_BLOCK_ROWS)
            at = {k: (int(e[b0 - 1]) if b0 else 0, int(e[b1 - 1])) for k, e in ends.items()}
            coef[b0:b1] = self._decode_block(cls[b0:b1], row_esc[b0:b1], words[slice(*at["word"])],
                                             lengths[b0:b1], bits[slice(*at["lo"])], escapes[slice(*at["esc"])])
        return self.synthesize(coef * self.step, raw, raws)

    def _decode_block(self, cls, row_esc, words, lengths, lo_bits, escapes) -> np.ndarray:
        raise NotImplementedError

    def max_payload_bytes(self, s, h):
        coded_row = 2 * self.max_words + 2 + (int(self.model.lo_bits_of.max()) + 7) // 8 + 1 + 2 * ROW_ESCAPES_MAX
        return len(self.fingerprint) + s + s * max(2 * h, coded_row)

    def payload_bytes(self, s, h):
        """Not fixed: the rANS code's length depends on the values. This is the bound (:meth:`max_payload_bytes`)."""
        return self.max_payload_bytes(s, h)


class _Model:
    """An :class:`AnsLevel` unpacked for coding: per class and component its table, raw bits and shrink; the
    encoder's choice of row class and symbols."""

    def __init__(self, lv: AnsLevel):
        self.level = lv
        self.tables = rans.FreqTables(lv.freq)
        self.classes = int(lv.class_log2_gain.size)
        self.table_of = lv.table_of.astype(np.int64)  # [C, r]
        self.shift_of = lv.shift.astype(np.int64)[self.table_of]  # [C, r] raw low bits per coefficient
        self.shrink_of = lv.shrink[self.table_of]  # [C, r]
        self.lo_bits_of = self.shift_of.sum(axis=1)  # [C] raw bits per row of each class
        self._edges = 0.5 * (lv.class_log2_gain[1:] + lv.class_log2_gain[:-1])  # nearest gain on the log scale
        with np.errstate(divide="ignore"):
            self._bits = rans.PREC - np.log2(lv.freq.astype(np.float64))  # [G, A] (inf: not codable)

    def row_class(self, z: np.ndarray) -> np.ndarray:
        """Class [S] of rows ``z`` [S, r] (coefficients in steps): the one whose gain is nearest the row's."""
        return np.searchsorted(self._edges, row_log2_gain(z, self.level.component_sd)).astype(np.int64)

    def reconstruct(self, cls: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Decoded coefficients (in steps) of integers ``q`` [S, r]: nonzero ones at the bin centroid."""
        return np.sign(q) * np.maximum(np.abs(q) - self.shrink_of[cls], 0.0)

    def quantize(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Code ``z`` [S, r] (coefficients in steps): row classes [S], the integers [S, r], their rANS symbols
        [S, r] (:data:`ESCAPE` where a table cannot code them) and the escape mask [S, r]."""
        cls = self.row_class(z)
        q = np.rint(z).astype(np.int64)
        sym = (q >> self.shift_of[cls]) + self.level.offset  # hi = floor(q / 2**shift), shifted
        escaped = ~self.tables.codable(sym, self.table_of[cls]) | (sym == ESCAPE)
        return cls, q, np.where(escaped, ESCAPE, sym), escaped

    def bits(self, cls: np.ndarray, sym: np.ndarray) -> np.ndarray:
        """Code length in bits of rANS symbols ``sym`` [S, r] in rows of class ``cls`` [S], raw bits included."""
        tab, shift = self.table_of[cls], self.shift_of[cls]
        return self._bits[tab, sym] + shift + np.where(sym == ESCAPE, ESCAPE_BITS, 0)


class PcaAnsCodec(RansRowsCodec):
    """An :class:`AnsLevel` of the bundle's PCA artifact. ``basis``: a :class:`shared.codecs_pca.PcaBasis`."""

    level_type, model_type = AnsLevel, _Model

    # -- payload: fingerprint | row bytes [S] | raw rows f16 | lo bits | escaped hi i16 | word counts [Sq - 1]
    #    u16 | rANS words ------------------------------------------------------------------------------------------
    def encode_payload(self, x):
        s, h = x.shape
        z = (x - self.mean) @ self.analysis / self.step  # [S, r] coefficients in steps, float64
        m = self.model
        cls, q, sym, escaped = m.quantize(z)  # [S], [S, r] x 3
        hi = q >> m.shift_of[cls]  # [S, r]
        n_esc = escaped.sum(axis=1)  # [S]
        raw = (n_esc > ROW_ESCAPES_MAX) | (escaped & ((hi < -0x8000) | (hi > 0x7FFF))).any(axis=1)  # [S]
        keep = ~raw
        row_byte = np.where(raw, RAW_ROW, cls | (n_esc << CLASS_BITS)).astype(np.uint8)  # [S]
        cls, q, sym, escaped, hi = cls[keep], q[keep], sym[keep], escaped[keep], hi[keep]
        shift = m.shift_of[cls]  # [Sq, r]
        words, lengths = rans.encode(sym, m.table_of[cls], m.tables)
        lo = q & ((1 << shift) - 1)  # [Sq, r]
        return b"".join([self.fingerprint, row_byte.tobytes(), to_f16(x[raw], f"{self.name} raw rows").tobytes(),
                         _pack_fields(lo, shift), hi[escaped].astype("<i2").tobytes(),
                         lengths[:-1].astype("<u2").tobytes(), words.astype("<u2").tobytes()])

    def _decode_block(self, cls, row_esc, words, lengths, lo_bits, escapes) -> np.ndarray:
        """Decoded coefficients [B, r] (in steps) of a block of coded rows of classes ``cls`` [B]."""
        m = self.model
        tab, shift = m.table_of[cls], m.shift_of[cls]  # [B, r]
        try:
            sym = rans.decode(words, lengths, tab, m.tables)  # [B, r]
        except rans.RansError as e:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: {e}") from None
        hi = sym - self.level.offset  # [B, r]
        escaped = sym == ESCAPE
        if (escaped.sum(axis=1) != row_esc).any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: a row's escape symbols differ from its row byte's count")
        again = escapes + self.level.offset
        if escapes.size and (m.tables.codable(again, tab[escaped]) & (again != ESCAPE)).any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: an escaped value its table codes (not canonical)")
        hi[escaped] = escapes
        return m.reconstruct(cls, (hi << shift) + _unpack_fields(lo_bits, shift))

def row_log2_gain(z: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """log2 of each row's scale [S]: the RMS of its coefficients ``z`` [S, r] over their spreads ``sd`` [r]."""
    return 0.5 * np.log2(np.maximum(((z / sd) ** 2).mean(axis=1), 1e-30))


# -- raw bit fields: per row, per coefficient, its ``shift`` low bits, LSB first ------------------------------

def _field_layout(shift: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bit fields of widths ``shift`` [S, r] laid end to end: first bit of each field [S * r], and per bit
    its field and its index within the field [B]."""
    w = shift.ravel()
    start = np.cumsum(w) - w  # [S * r]
    owner = np.repeat(np.arange(w.size), w)  # [B]
    return start, owner, np.arange(owner.size) - start[owner]


def _pack_fields(lo: np.ndarray, shift: np.ndarray) -> bytes:
    _, owner, bit = _field_layout(shift)
    return np.packbits(((lo.ravel()[owner] >> bit) & 1).astype(np.uint8), bitorder="little").tobytes()


def _unpack_fields(bits: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_pack_fields`: ``bits`` (uint8 0/1, exactly ``shift.sum()`` of them) -> lo [S, r]."""
    start, _, bit = _field_layout(shift)
    wide = shift.ravel() > 0
    lo = np.zeros(wide.size, np.int64)
    if wide.any():  # each coefficient's bits are one contiguous, nonempty run
        lo[wide] = np.add.reduceat(bits.astype(np.int64) << bit, start[wide])
    return lo.reshape(shift.shape)


# -- calibration (pure numpy; shared.codecs_pca.calibrate_pca calls it) ----------------------------------------

TABLES_PER_OCTAVE = 4
TAU_LOG2_RANGE = (-6.0, 10.0)  # table scales, in steps: 1/64 .. 1024
SPAN = 16.0  # a table codes |q| up to SPAN x its scale (+2); beyond, the value is escaped
HI_SCALE = 8.0  # shift so that the scale of hi is at most this


@functools.lru_cache(maxsize=8)
def gg_tables(beta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tables of a discretised generalized Gaussian (shape ``beta``; 2 = Gaussian, 1 = Laplace) at scales
    (standard deviations, in steps) ``2**(k / TABLES_PER_OCTAVE)`` over :data:`TAU_LOG2_RANGE`. Returns
    (log2 scale [G], freq uint16 [G, A], shift uint8 [G], shrink float64 [G])."""
    lo, hi = TAU_LOG2_RANGE
    log2_tau = np.arange(lo * TABLES_PER_OCTAVE, hi * TABLES_PER_OCTAVE + 1) / TABLES_PER_OCTAVE  # [G]
    shifts = np.clip(np.ceil(log2_tau - math.log2(HI_SCALE)), 0, MAX_SHIFT).astype(np.int64)  # [G]
    half = int(math.ceil(SPAN * HI_SCALE)) + 2
    freqs, shrinks = [], []
    alpha_unit = math.sqrt(math.gamma(1 / beta) / math.gamma(3 / beta))  # scale of unit variance
    for lt, sh in zip(log2_tau, shifts):
        tau = 2.0 ** lt
        qmax = int(math.ceil(SPAN * tau)) + 2
        sub = max(4, min(64, int(256 // (1 + qmax))))  # midpoint-rule points per bin
        q = np.arange(-qmax, qmax + 1)  # [Q]
        t = q[:, None] + (np.arange(sub) + 0.5) / sub - 0.5  # [Q, sub] points inside each bin (in steps)
        dens = np.exp(-np.abs(t / (alpha_unit * tau)) ** beta)
        p = dens.sum(axis=1)
        p /= p.sum()  # [Q]
        cent = (np.abs(t) * dens).sum(axis=1) / np.maximum(dens.sum(axis=1), 1e-300)
        nz = q != 0
        shrinks.append(float(np.clip((p[nz] * (np.abs(q[nz]) - cent[nz])).sum() / max(p[nz].sum(), 1e-300), 0, 0.5)))
        h_idx = (q >> sh) + half + 1  # symbol of each q: hi + A / 2 (AnsLevel.offset); 0 is ESCAPE
        ph = np.bincount(h_idx, weights=p, minlength=2 * half + 2)  # [A]: hi in -half..half
        ph[ESCAPE] = 1e-12  # the least frequency
        freqs.append(quantize_freq(ph))
    out = log2_tau, np.stack(freqs).astype(np.uint16), shifts.astype(np.uint8), np.array(shrinks)
    for a in out:
        a.flags.writeable = False  # cached: shared by every level fitted with this shape
    return out


def quantize_freq(p: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to :data:`rans.M`, >= 1 wherever ``p > 0``, close to ``p * M``."""
    f = np.where(p > 0, np.maximum(1, np.floor(p / p.sum() * rans.M)), 0).astype(np.int64)
    while f.sum() != rans.M:  # hand the rounding error to (or take it from) the most probable symbols
        d = rans.M - int(f.sum())
        order = np.argsort(-p)
        for i in order[:abs(d)]:
            if d > 0 or f[i] > 1:
                f[i] += 1 if d > 0 else -1
    return f


@dataclass(frozen=True)
class AnsFit:
    """How :func:`fit_ans_level` shapes a level (defaults: docs/quality.md, "PCA codecs")."""

    drop: float = 0.3  # components whose calibration spread is below drop x step are not sent
    beta: float = 1.5  # shape of the tables' generalized Gaussian (2 = Gaussian, 1 = Laplace)
    classes: int = 16  # row scale classes
    class_step: float = 0.25  # octaves between classes
    folds: int = 3  # component spreads measured on held-out folds of the calibration (shared.codecs_pca.heldout_sd)


def fit_ans_level(coef: np.ndarray, sd: np.ndarray, step: float, fit: AnsFit) -> tuple[AnsLevel, float]:
    """The level for calibration coefficients ``coef`` [T, H] (PCA order; ``sd`` [H] the components'
    standard deviations, ideally on held-out rows) at ``step``: ``fit.classes`` row classes ``fit.class_step``
    octaves apart around the median row gain; the table of component j in class c is the one whose scale is
    nearest ``sd[j] * 2**gain[c]``. Returns the level and its ideal code length on ``coef`` in bits per hidden
    element (row bytes, raw bits, escapes and the rANS state included)."""
    t, h = coef.shape
    sd = sd / step  # [H] in steps
    r = max(1, int(np.count_nonzero(sd >= fit.drop)))
    z = coef[:, :r] / step  # [T, r]
    log2_gain = row_log2_gain(z, sd[:r])  # [T]
    gains = (np.arange(fit.classes) - (fit.classes - 1) / 2) * fit.class_step + float(np.median(log2_gain))  # [C]
    log2_tau, freq, shift, shrink = gg_tables(fit.beta)
    want = np.log2(sd[:r])[None, :] + gains[:, None]  # [C, r] log2 scale of component j in class c
    table_of = np.clip(np.rint((want - log2_tau[0]) * TABLES_PER_OCTAVE), 0, log2_tau.size - 1).astype(np.uint8)
    level = AnsLevel(float(step), sd[:r].astype(np.float64), gains, table_of, freq, shift, shrink)
    m = _Model(level)
    cls, _, sym, _ = m.quantize(z)
    bits = m.bits(cls, sym).sum(axis=1)  # [T] (what rANS reaches within its 32-bit state per row)
    return level, float((bits.mean() + 8 + 16 * rans.STATE_WORDS) / h)
