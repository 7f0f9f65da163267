"""The PCA transform coder with trellis-coded (dependent) quantization: ``pca-tcq-compact``.

The transform, row classes, tables and payload layout are those of :mod:`shared.codecs_pca_ans`
(``pca-ans-compact``); what differs is the quantizer. Instead of rounding every coefficient to a multiple of
one step, the coefficients of a row are quantized *dependently* (trellis-coded quantization, Marcellin &
Fischer 1990; the 4-state form of H.266/VVC's dependent quantization, Schwarz et al. 2019): two scalar
quantizers, ``Q0`` with the levels ``2k * step`` and ``Q1`` with ``(2k - sgn k) * step`` (0, ±1, ±3, ...
steps), are interleaved by a 4-state machine driven by the parity of the integers already coded in the row
(``next = TRANSITIONS[state][k & 1]``, ``Q1`` in states 2 and 3). Each quantizer alone is twice as coarse as
the union, but the encoder picks, by a Viterbi search over the row's components, the path that minimises
``squared error + lam * bits``; the union of the reachable levels packs the space more densely than one
uniform grid (the space-filling gain of a lattice, about 1 dB here). The decoder needs no search: it follows
the state machine as it decodes the integers.

Coefficient ``j`` of a row of class ``c`` in a state using quantizer ``Q`` is coded with rANS under table
``table_of[Q, c, j]`` (a discretised generalized Gaussian, as for ``pca-ans-compact``; both quantizers'
tables of a coefficient have the same raw low bits, so the raw bit fields are laid out before decoding).
The decoder picks each table as the state machine moves (:func:`shared.rans.decode_dynamic`).
A payload of at most :data:`shared.rans.SCALAR_ROWS` rows (a one-row DecodeStep) is searched and coded row by
row in Python numbers (:func:`_viterbi_row`, :func:`shared.rans.decode_row`): the same bytes and values.

Payload layout (docs/protocol.md, "Codec payloads", as ``pca-ans-compact``): fingerprint | row bytes [S] |
raw rows f16 | raw low bits | escaped hi i16 | word counts [Sq - 1] u16 | rANS words. Quality:
docs/quality.md, "PCA codecs".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import rans
from .codec_base import to_f16
from .codecs_pca_ans import (CLASS_BITS, ESCAPE, ESCAPE_BITS, MAX_CLASSES, MAX_SHIFT, RAW_ROW, ROW_ESCAPES_MAX,
                             TABLES_PER_OCTAVE, RansRowsCodec, _pack_fields, _unpack_fields, gg_tables, quantize_freq,
                             row_log2_gain)
from .errors import BAD_TENSOR, ProtocolError

TCQ_LEVELS = ("pca-tcq-compact",)
TRANSITIONS = np.array([[0, 2], [2, 0], [1, 3], [3, 1]], np.int64)  # next state [state, parity of k]
# the two predecessors (state, parity of k) of every state, for the Viterbi search
_PRED_STATE = np.array([[0, 1], [2, 3], [0, 1], [2, 3]], np.int64)
_PRED_PARITY = np.array([[0, 1], [0, 1], [1, 0], [1, 0]], np.int64)
_CAND = np.arange(-1, 3)  # candidate integers around floor(t / 2) (and zero), per quantizer
SEARCH_BLOCK_ROWS = 64  # rows searched at a time (bounds the [rows, r, 2, 5] candidate arrays)


def levels_of(k: np.ndarray, quantizer: np.ndarray) -> np.ndarray:
    """Reconstruction levels (in steps) of integers ``k`` under quantizers ``quantizer`` (0 or 1)."""
    return np.where(quantizer == 0, 2 * k, 2 * k - np.sign(k))


@dataclass(frozen=True)
class TcqLevel:
    """One trellis-coded level: ``step`` (the union's spacing), ``lam`` (the encoder's rate weight, step² per
    bit), the row classes' gains (log2, [C]), ``table_of`` uint8 [2, C, r] (the table of component j in a row
    of class c under quantizer Q) and per table ``freq`` [G, A] and ``shift`` uint8 [G]."""

    step: float
    lam: float
    component_sd: np.ndarray  # float64 [r]: spread of each sent component, in steps
    class_log2_gain: np.ndarray  # float64 [C]
    table_of: np.ndarray  # uint8 [2, C, r]
    freq: np.ndarray  # uint16 [G, A]
    shift: np.ndarray  # uint8 [G]
    shrink: np.ndarray  # float64 [G]: a nonzero level decodes this many steps nearer zero (its calibrated centroid)

    def __post_init__(self):
        _, c, r = self.table_of.shape if self.table_of.ndim == 3 and self.table_of.shape[0] == 2 else (0, 0, 0)
        g = self.freq.shape[0] if self.freq.ndim == 2 else 0
        ok = (np.isfinite(self.step) and self.step > 0 and np.isfinite(self.lam) and self.lam >= 0
              and 1 <= c <= MAX_CLASSES and r >= 1 and g >= 1 and self.table_of.dtype == np.uint8
              and self.class_log2_gain.shape == (c,) and np.isfinite(self.class_log2_gain).all()
              and self.component_sd.shape == (r,) and np.isfinite(self.component_sd).all()
              and (self.component_sd > 0).all() and self.shift.shape == (g,) and self.shift.dtype == np.uint8
              and self.freq.dtype == np.uint16 and int(self.table_of.max()) < g
              and int(self.shift.max()) <= MAX_SHIFT and self.freq.shape[1] % 2 == 0
              and (self.freq[:, ESCAPE] > 0).all() and self.shrink.shape == (g,)
              and np.isfinite(self.shrink).all() and ((self.shrink >= 0) & (self.shrink < 1)).all())
        if not ok:
            raise ValueError("tcq level: malformed tables")
        if (self.shift[self.table_of[0]] != self.shift[self.table_of[1]]).any():
            raise ValueError("tcq level: both quantizers' tables of a coefficient must have the same raw bits")
        if (self.freq.astype(np.int64).sum(axis=1) != rans.M).any():
            raise ValueError(f"tcq level: every table's frequencies must sum to {rans.M}")

    @property
    def r(self) -> int:
        return int(self.table_of.shape[2])

    @property
    def offset(self) -> int:
        return self.freq.shape[1] // 2  # symbol = hi + offset

    FIELDS = ("step", "lam", "component_sd", "class_log2_gain", "table_of", "freq", "shift", "shrink")

    def arrays(self) -> dict[str, np.ndarray]:
        return {"step": np.array([self.step], np.float64), "lam": np.array([self.lam], np.float64),
                "component_sd": self.component_sd, "class_log2_gain": self.class_log2_gain,
                "table_of": self.table_of, "freq": self.freq, "shift": self.shift, "shrink": self.shrink}

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> TcqLevel:
        if a["step"].shape != (1,) or a["lam"].shape != (1,):
            raise ValueError("tcq level: step and lam must be one float64 each")
        return cls(float(a["step"][0]), float(a["lam"][0]), a["component_sd"].astype(np.float64),
                   a["class_log2_gain"].astype(np.float64), a["table_of"], a["freq"], a["shift"],
                   a["shrink"].astype(np.float64))

    def digest_bytes(self) -> bytes:
        return b"".join(np.ascontiguousarray(v).tobytes() for v in self.arrays().values())


class _TcqModel:
    """A :class:`TcqLevel` unpacked for coding: tables, raw bits and code lengths per class and component,
    and the encoder's Viterbi search."""

    def __init__(self, lv: TcqLevel):
        self.level = lv
        self.tables = rans.FreqTables(lv.freq)
        self.classes = int(lv.class_log2_gain.size)
        self.table_of = lv.table_of.astype(np.int64)  # [2, C, r]
        self.shift_of = lv.shift.astype(np.int64)[self.table_of[0]]  # [C, r] (the same under Q1)
        self.lo_bits_of = self.shift_of.sum(axis=1)  # [C]
        self._edges = 0.5 * (lv.class_log2_gain[1:] + lv.class_log2_gain[:-1])
        with np.errstate(divide="ignore"):
            bits = rans.PREC - np.log2(lv.freq.astype(np.float64))  # [G, A] (inf: not codable)
        bits[:, ESCAPE] += ESCAPE_BITS  # an escape costs its symbol and the int16 value
        self._bits = bits
        self._bits_flat = bits.ravel()
        self.alphabet = lv.freq.shape[1]

    def row_class(self, z: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._edges, row_log2_gain(z, self.level.component_sd)).astype(np.int64)

    def symbol_bits(self, tab: np.ndarray, k: np.ndarray, shift: np.ndarray) -> np.ndarray:
        """Code length (bits) of integers ``k`` under tables ``tab`` with ``shift`` raw bits (escapes included)."""
        sym = (k >> shift) + self.level.offset
        ok = (sym > ESCAPE) & (sym < self.alphabet)
        b = self._bits_flat[tab * self.alphabet + np.where(ok, sym, ESCAPE)]
        esc = self._bits_flat[tab * self.alphabet + ESCAPE]
        return np.where(ok & np.isfinite(b), b, esc) + shift

    def quantize(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Viterbi search over rows ``z`` [S, r] (coefficients in steps): row classes [S], the integers
        [S, r] and the quantizer each was coded with [S, r] (rows in blocks: the search is per row)."""
        s, r = z.shape
        cls = self.row_class(z)
        k = np.empty((s, r), np.int64)
        qz = np.empty((s, r), np.int64)
        for b0 in range(0, s, SEARCH_BLOCK_ROWS):
            b1 = min(s, b0 + SEARCH_BLOCK_ROWS)
            k[b0:b1], qz[b0:b1] = self._search(z[b0:b1], cls[b0:b1])
        return cls, k, qz

    def _search(self, z: np.ndarray, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s, r = z.shape
        # the best integer of each quantizer and parity for every coefficient does not depend on the path:
        # costs [S, r, quantizer, parity] at once, then the path search is a few steps per component
        t = z[:, :, None]  # [S, r, 1]
        zero = np.zeros((s, r, 1), np.int64)
        kk = np.stack([np.concatenate([np.floor(t / 2).astype(np.int64) + _CAND, zero], axis=2),
                       np.concatenate([np.floor((t + 1) / 2).astype(np.int64) + _CAND, zero], axis=2)],
                      axis=2)  # [S, r, 2, 5]: Q0's levels 2k and Q1's levels 2k - sgn k around t
        mu = levels_of(kk, np.array([0, 1])[None, None, :, None])
        tab = np.moveaxis(self.table_of[:, cls, :], 0, 2)[..., None]  # [S, r, 2, 1]
        c = (t[..., None] - mu) ** 2 + self.level.lam * self.symbol_bits(tab, kk, self.shift_of[cls][:, :, None, None])
        par = kk & 1
        ccost = np.empty((s, r, 2, 2))
        ck = np.empty((s, r, 2, 2), np.int64)
        for p in (0, 1):
            cp = np.where(par == p, c, np.inf)
            i = cp.argmin(axis=3)[..., None]
            ccost[..., p] = np.take_along_axis(cp, i, 3)[..., 0]
            ck[..., p] = np.take_along_axis(kk, i, 3)[..., 0]
        step_cost = ccost[:, :, _PRED_STATE >> 1, _PRED_PARITY]  # [S, r, 4 next, 2 preds]
        step_k = ck[:, :, _PRED_STATE >> 1, _PRED_PARITY]
        if s <= rans.SCALAR_ROWS:  # a few rows: the path search in Python floats (numpy's call overhead dominates)
            path = np.array([_viterbi_row(c.reshape(r, 8).tolist()) for c in step_cost], np.int64)  # [S, 2, r]
            state, pick = path[:, 0], path[:, 1]
        else:
            state, pick = _viterbi(step_cost)
        return step_k[np.arange(s)[:, None], np.arange(r), state, pick], _PRED_STATE[state, pick] >> 1


def _viterbi(step_cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least-cost path through the trellis of every row, vectorised over the rows: ``step_cost`` [S, r, 4
    next states, 2 predecessors] -> the path's state after each component and which of its two predecessors it
    came from ([S, r] each). Paths start in state 0; ties go to the first predecessor, then the first state."""
    s, r = step_cost.shape[:2]
    cost = np.full((s, 4), np.inf)
    cost[:, 0] = 0.0
    back = np.empty((r, s, 4), np.int64)  # which of the two predecessors
    for j in range(r):
        tot = cost[:, _PRED_STATE] + step_cost[:, j]  # [S, 4, 2]
        back[j] = tot[:, :, 1] < tot[:, :, 0]
        cost = np.minimum(tot[:, :, 0], tot[:, :, 1])
    st = cost.argmin(axis=1)  # [S]
    rows = np.arange(s)
    state, pick = np.empty((s, r), np.int64), np.empty((s, r), np.int64)
    for j in range(r - 1, -1, -1):
        state[:, j], pick[:, j] = st, back[j][rows, st]
        st = _PRED_STATE[st, pick[:, j]]
    return state, pick


def _viterbi_row(step_cost: list) -> tuple[list[int], list[int]]:
    """:func:`_viterbi` for one row, in Python floats (the same sums, the same ties):
    ``step_cost`` [r][8] (next state x predecessor, flattened) -> the best path's state after each component
    and which of its two predecessors it came from ([r] each). Unrolled for :data:`_PRED_STATE` (states 0
    and 2 come from 0 | 1, states 1 and 3 from 2 | 3)."""
    c0, c1, c2, c3 = 0.0, np.inf, np.inf, np.inf
    back = []
    for s00, s01, s10, s11, s20, s21, s30, s31 in step_cost:
        a0, b0, a1, b1, a2, b2, a3, b3 = c0 + s00, c1 + s01, c2 + s10, c3 + s11, c0 + s20, c1 + s21, c2 + s30, c3 + s31
        p0, p1, p2, p3 = b0 < a0, b1 < a1, b2 < a2, b3 < a3  # ties: the first predecessor
        back.append((p0, p1, p2, p3))
        c0, c1, c2, c3 = b0 if p0 else a0, b1 if p1 else a1, b2 if p2 else a2, b3 if p3 else a3
    cost = [c0, c1, c2, c3]
    state = cost.index(min(cost))  # the first of equal costs, as argmin
    pred = _PRED_STATE.tolist()
    r = len(step_cost)
    states, picks = [0] * r, [0] * r
    for j in range(r - 1, -1, -1):
        states[j], picks[j] = state, int(back[j][state])
        state = pred[state][picks[j]]
    return states, picks


class PcaTcqCodec(RansRowsCodec):
    """A :class:`TcqLevel` of the bundle's PCA artifact. ``basis``: a :class:`shared.codecs_pca.PcaBasis`."""

    level_type, model_type = TcqLevel, _TcqModel

    def encode_payload(self, x):
        s, h = x.shape
        m = self.model
        z = (x - self.mean) @ self.analysis / self.step  # [S, r] in steps
        cls, k, qz = m.quantize(z)
        tab = np.where(qz == 0, m.table_of[0][cls], m.table_of[1][cls])  # [S, r]
        shift = m.shift_of[cls]
        hi = k >> shift
        sym = hi + self.level.offset
        escaped = ~m.tables.codable(sym, tab) | (sym == ESCAPE)
        n_esc = escaped.sum(axis=1)
        raw = (n_esc > ROW_ESCAPES_MAX) | (escaped & ((hi < -0x8000) | (hi > 0x7FFF))).any(axis=1)
        keep = ~raw
        row_byte = np.where(raw, RAW_ROW, cls | (n_esc << CLASS_BITS)).astype(np.uint8)
        sym, tab, escaped, hi, k, shift = (a[keep] for a in (np.where(escaped, ESCAPE, sym), tab, escaped, hi, k,
                                                             shift))
        words, lengths = rans.encode(sym, tab, m.tables)
        lo = k & ((1 << shift) - 1)
        return b"".join([self.fingerprint, row_byte.tobytes(), to_f16(x[raw], f"{self.name} raw rows").tobytes(),
                         _pack_fields(lo, shift), hi[escaped].astype("<i2").tobytes(),
                         lengths[:-1].astype("<u2").tobytes(), words.astype("<u2").tobytes()])

    def _decode_block(self, cls, row_esc, words, lengths, lo_bits, escapes) -> np.ndarray:
        """Decoded coefficients [B, r] (in steps) of a block of coded rows of classes ``cls`` [B]: the rANS
        symbols, each under the table of its row's state, the state moved by each integer's parity."""
        m = self.model
        tab0, tab1 = m.table_of[0][cls], m.table_of[1][cls]  # [B, r]
        shift = m.shift_of[cls]
        lo = _unpack_fields(lo_bits, shift)  # [B, r]
        decode = self._integers_by_row if cls.size <= rans.SCALAR_ROWS else self._integers
        try:
            k, qz = decode(tab0, tab1, shift, lo, row_esc, words, lengths, escapes)  # [B, r] x 2
        except rans.RansError as e:
            raise ProtocolError(BAD_TENSOR, f"{self.name}: {e}") from None
        mu = levels_of(k, qz).astype(np.float64)
        return mu - np.sign(mu) * self.level.shrink[np.where(qz == 0, tab0, tab1)]

    def _integers(self, tab0, tab1, shift, lo, row_esc, words, lengths, escapes):
        """The integers [B, r] and their quantizers [B, r] of a block of rows, vectorised over the rows."""
        m, off = self.model, self.level.offset
        b, r = tab0.shape
        esc_ptr = np.cumsum(row_esc) - row_esc  # [B] next escape of each row
        last_esc = max(escapes.size - 1, 0)
        esc_vals = escapes if escapes.size else np.zeros(1, np.int64)
        esc_used = np.zeros(b, np.int64)
        state = np.zeros(b, np.int64)
        k = np.empty((b, r), np.int64)
        qz = np.empty((b, r), np.int64)
        non_canonical = np.zeros(b, bool)

        def absorb(j, sym):  # the integer of symbol j, and the state it leads to
            nonlocal state
            esc = sym == ESCAPE
            hi = sym - off
            if esc.any():
                v = esc_vals[np.minimum(esc_ptr + esc_used, last_esc)]
                hi = np.where(esc, v, hi)
                again = v + off
                t = np.where(qz[:, j] == 0, tab0[:, j], tab1[:, j])
                non_canonical[:] |= esc & m.tables.codable(again, t) & (again != ESCAPE)
                esc_used[:] += esc
            k[:, j] = (hi << shift[:, j]) + lo[:, j]
            state = TRANSITIONS[state, k[:, j] & 1]

        def next_tables(j, prev):
            if prev is not None:
                absorb(j - 1, prev)
            qz[:, j] = state >> 1
            return np.where(qz[:, j] == 0, tab0[:, j], tab1[:, j])

        sym = rans.decode_dynamic(words, lengths, r, m.tables, next_tables)
        absorb(r - 1, sym[:, r - 1])
        if (esc_used != row_esc).any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: a row's escape symbols differ from its row byte's count")
        if non_canonical.any():
            raise ProtocolError(BAD_TENSOR, f"{self.name}: an escaped value its table codes (not canonical)")
        return k, qz

    def _integers_by_row(self, tab0, tab1, shift, lo, row_esc, words, lengths, escapes):
        """:meth:`_integers` row by row in Python ints (:func:`shared.rans.decode_row`), for a few rows."""
        freq, _, _ = self.model.tables.lists()
        trans = TRANSITIONS.tolist()
        lengths = rans.check_lengths(words, lengths)
        words, escapes = words.tolist(), escapes.tolist()
        w_end, e_end = np.cumsum(lengths).tolist(), np.cumsum(row_esc).tolist()
        ks, qzs = [], []
        for i, (t0, t1, sh, lw) in enumerate(zip(tab0.tolist(), tab1.tolist(), shift.tolist(), lo.tolist())):
            k, qz = self._row_integers(t0, t1, sh, lw, escapes[e_end[i] - int(row_esc[i]):e_end[i]],
                                       words[w_end[i] - int(lengths[i]):w_end[i]], freq, trans)
            ks.append(k)
            qzs.append(qz)
        return np.array(ks, np.int64).reshape(-1, self.r), np.array(qzs, np.int64).reshape(-1, self.r)

    def _row_integers(self, t0, t1, sh, lw, esc, words, freq, trans) -> tuple[list[int], list[int]]:
        """One row of :meth:`_integers_by_row`: its integers and trellis states (lists of ``r``) from its rANS
        words and escapes, given its tables ``t0`` / ``t1``, shifts ``sh`` and offsets ``lw`` (lists of ``r``)."""
        m, off, r = self.model, self.level.offset, self.r
        alphabet = m.tables.alphabet
        k, qz = [], []
        state = used = 0

        def integer(j, sym):  # the integer of symbol j (its escape's value for the escape symbol)
            nonlocal used
            if sym != ESCAPE:
                return ((sym - off) << sh[j]) + lw[j]
            if used >= len(esc):
                raise ProtocolError(BAD_TENSOR, f"{self.name}: a row's escape symbols differ from its row "
                                                "byte's count")
            v, used = esc[used], used + 1
            again, t = v + off, (t1[j] if qz[j] else t0[j])
            if 0 < again < alphabet and freq[t * alphabet + again] > 0:
                raise ProtocolError(BAD_TENSOR, f"{self.name}: an escaped value its table codes (not canonical)")
            return (v << sh[j]) + lw[j]

        def next_table(j, prev):
            nonlocal state
            if prev is not None:
                k.append(integer(j - 1, prev))
                state = trans[state][k[-1] & 1]
            qz.append(state >> 1)
            return t1[j] if state >> 1 else t0[j]

        sym = rans.decode_row(words, r, m.tables, next_table)
        k.append(integer(r - 1, sym[-1]))
        if used != len(esc):
            raise ProtocolError(BAD_TENSOR, f"{self.name}: a row's escape symbols differ from its row byte's count")
        return k, qz


# -- calibration (pure numpy; shared.codecs_pca.calibrate_pca calls it) ----------------------------------------

@dataclass(frozen=True)
class TcqFit:
    """How :func:`fit_tcq_level` shapes a level (defaults: docs/quality.md, "PCA codecs")."""

    lam: float = 0.2  # rate weight of the Viterbi search, step² per bit
    drop: float = 0.5  # components whose spread is below drop x step are not sent
    beta: float = 1.5  # shape of the tables' generalized Gaussian
    classes: int = 16
    class_step: float = 0.25  # octaves between classes
    refine: int = 2  # rounds of re-estimating the tables from the search's own integers on the calibration
    prior: float = 32.0  # pseudo-counts of the generalized-Gaussian prior in a re-estimated table


def fit_tcq_level(coef: np.ndarray, sd: np.ndarray, step: float, fit: TcqFit) -> tuple[TcqLevel, float]:
    """The level for calibration coefficients ``coef`` [T, H] (PCA order; ``sd`` [H] the components' spreads,
    ideally on held-out rows) at union spacing ``step``; the tables of component j in class c are the ones
    nearest ``sd[j] * 2**gain[c] / 2`` (an integer of either quantizer spans two steps). Returns the level and
    its code length on ``coef`` in bits per hidden element (row bytes and the rANS state included)."""
    t, h = coef.shape
    sd = sd / step
    r = max(1, int(np.count_nonzero(sd >= fit.drop)))
    z = coef[:, :r] / step
    log2_gain = row_log2_gain(z, sd[:r])
    gains = (np.arange(fit.classes) - (fit.classes - 1) / 2) * fit.class_step + float(np.median(log2_gain))
    log2_tau, freq, shift, _ = gg_tables(fit.beta)
    g = log2_tau.size
    want = np.log2(sd[:r] / 2)[None, :] + gains[:, None]  # [C, r]
    t0 = np.clip(np.rint((want - log2_tau[0]) * TABLES_PER_OCTAVE), 0, g - 1).astype(np.int64)
    table_of = np.stack([t0, t0 + g]).astype(np.uint8)  # Q1's tables follow Q0's: the same scales and raw bits
    prior = np.concatenate([freq, freq]).astype(np.float64) / rans.M  # [2G, A]
    shift2 = np.concatenate([shift, shift])
    no_shrink = np.zeros(2 * g)
    level = TcqLevel(float(step), float(fit.lam), sd[:r].astype(np.float64), gains, table_of,
                     np.concatenate([freq, freq]), shift2, no_shrink)
    for rnd in range(fit.refine + 1):
        m = _TcqModel(level)
        cls, k, qz = m.quantize(z)
        tab = np.where(qz == 0, m.table_of[0][cls], m.table_of[1][cls])  # [T, r]
        bits = m.symbol_bits(tab, k, m.shift_of[cls]).sum(axis=1)
        if rnd == fit.refine:
            # centroids: how far past the calibration values each table's nonzero levels lie, on average
            mu = levels_of(k, qz)
            nz = mu != 0
            over = np.bincount(tab[nz], weights=((mu - z) * np.sign(mu))[nz], minlength=2 * g)
            cnt = np.bincount(tab[nz], minlength=2 * g)
            shrink = np.clip(over / np.maximum(cnt, 1) * (cnt >= 16), 0, 0.5)
            level = TcqLevel(level.step, level.lam, level.component_sd, gains, table_of, level.freq, shift2, shrink)
            break
        # re-estimate every table from the integers the search chose under it (the prior keeps unseen ones)
        a = freq.shape[1]
        sym = (k >> m.shift_of[cls]) + level.offset
        sym = np.where((sym > ESCAPE) & (sym < a), sym, ESCAPE)
        counts = np.bincount((tab * a + sym).ravel(), minlength=2 * g * a).reshape(2 * g, a).astype(np.float64)
        p = counts + fit.prior * prior
        p[:, ESCAPE] = np.maximum(p[:, ESCAPE], 1e-9)
        level = TcqLevel(float(step), float(fit.lam), sd[:r].astype(np.float64), gains, table_of,
                         np.stack([quantize_freq(row) for row in p]).astype(np.uint16), shift2, no_shrink)
    return level, float((bits.mean() + 8 + 16 * rans.STATE_WORDS) / h)
