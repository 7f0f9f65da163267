"""Row-parallel rANS: an entropy coder for many independent rows of symbols, vectorised over the rows.

Range asymmetric numeral systems (Duda, "Asymmetric numeral systems", 2013; the 32-bit state, 16-bit
renormalisation variant of Giesen's ryg_rans) with static symbol distributions: row ``i`` codes its
symbols ``symbols[i, 0..n)``, symbol ``j`` under distribution ``tables[i, j]`` of a :class:`FreqTables`.
Every row has its own coder state, so the numpy loop runs over the ``n`` symbols of a row and each step
works on all rows at once; a row's stream depends on that row alone (a chunk of rows and the same rows
coded one by one give the same streams).

A row's stream is a sequence of 16-bit words: the final encoder state (two words, high first), then the
renormalisation words in the order the decoder consumes them. Probabilities are ``freq / 2**PREC``; every
symbol a table can code has ``freq >= 1``. The decoder checks that each row consumed exactly its words and
ended in the encoder's initial state - a truncated or altered stream is refused (:class:`RansError`), never
read out of bounds.

A few rows (at most :data:`SCALAR_ROWS`, e.g. a one-row DecodeStep) are coded row by row in Python ints
(:func:`encode_row`, :func:`decode_row`) instead: a numpy step costs microseconds of call overhead whatever
its size, so a one-row message would pay ~10 numpy calls per symbol. Both paths write and read the same
streams (tests/shared/test_rans.py checks it).
"""

from __future__ import annotations

import numpy as np

PREC = 12  # probability precision: frequencies sum to 2**PREC
M = 1 << PREC
L = 1 << 16  # the state lives in [L, 2**32); encoder start state and decoder end state
STATE_WORDS = 2
SCALAR_ROWS = 4  # at most this many rows: coded row by row in Python ints


class RansError(ValueError):
    """A stream that this coder did not write (wrong length, or not ending in the initial state)."""


class FreqTables:
    """``G`` static distributions over symbols ``0..A-1``: ``freq`` [G, A] non-negative integers, each row
    summing to :data:`M` (a symbol of frequency 0 cannot be coded under that table)."""

    def __init__(self, freq: np.ndarray):
        freq = np.asarray(freq)
        if freq.ndim != 2 or freq.shape[0] < 1 or freq.shape[1] < 1 or freq.dtype.kind not in "iu":
            raise ValueError(f"rans tables: integer freq [G, A] expected, got {freq.dtype} {freq.shape}")
        if (freq < 0).any() or (freq.sum(axis=1) != M).any():
            raise ValueError(f"rans tables: every table's frequencies must be >= 0 and sum to {M}")
        g, a = freq.shape
        self.freq = freq.astype(np.int64)  # [G, A]
        self.cum = np.concatenate([np.zeros((g, 1), np.int64), np.cumsum(self.freq, axis=1)[:, :-1]], 1)  # [G, A]
        self.alphabet = a
        # symbol of every slot 0..M-1 of every table: slot s belongs to the symbol whose [cum, cum + freq) holds it
        self.lookup = np.repeat(np.tile(np.arange(a), g), self.freq.ravel()).astype(np.int64)  # [G * M]
        self._freq_flat = self.freq.ravel()
        self._cum_flat = self.cum.ravel()
        self._lists = None

    def lists(self) -> tuple[list, list, list]:
        """``freq``, ``cum`` and ``lookup`` flattened as Python lists (built on first use, for the row coders)."""
        if self._lists is None:
            self._lists = (self._freq_flat.tolist(), self._cum_flat.tolist(), self.lookup.tolist())
        return self._lists

    def codable(self, symbols: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """bool mask: ``symbols`` lies in the alphabet and has a nonzero frequency under ``tables``."""
        ok = (symbols >= 0) & (symbols < self.alphabet)
        f = self._freq_flat[np.where(ok, tables * self.alphabet + symbols, 0)]
        return ok & (f > 0)


def encode(symbols: np.ndarray, tables: np.ndarray, ft: FreqTables) -> tuple[np.ndarray, np.ndarray]:
    """Code ``symbols`` [S, n] (ints) under ``tables`` [S, n] (indices into ``ft``; every symbol must be
    :meth:`FreqTables.codable`). Returns the streams of all rows concatenated (uint16 [sum(lengths)]) and
    each row's length in words (int64 [S], each >= :data:`STATE_WORDS`)."""
    s, n = symbols.shape
    idx = (tables * ft.alphabet + symbols).T  # [n, S]
    if (ft._freq_flat[idx] == 0).any():
        raise ValueError("rans encode: a symbol of frequency 0 under its table")
    if s <= SCALAR_ROWS:
        rows = [encode_row(row, ft) for row in idx.T.tolist()]
        return (np.array([w for r in rows for w in r], np.uint16),
                np.array([len(r) for r in rows], np.int64))
    freq = ft._freq_flat[idx].astype(np.uint64)  # [n, S]
    start = ft._cum_flat[idx].astype(np.uint64)  # [n, S]
    limit = freq << np.uint64(32 - PREC)  # renormalise (emit 16 bits) when the state would overflow
    x = np.full(s, L, np.uint64)  # [S]
    out = np.zeros((s, n + STATE_WORDS + 1), np.uint16)  # emitted words in encoder order (+1: scratch slot)
    cnt = np.zeros(s, np.int64)  # [S]
    rows = np.arange(s)
    low, sixteen, prec = np.uint64(0xFFFF), np.uint64(16), np.uint64(PREC)
    for j in range(n - 1, -1, -1):  # rANS is last-in first-out: encode backwards, decode forwards
        emit = x >= limit[j]
        out[rows, cnt] = x & low  # kept only where emitted (the slot is overwritten otherwise)
        cnt += emit
        x = np.where(emit, x >> sixteen, x)
        q, r = np.divmod(x, freq[j])
        x = (q << prec) + r + start[j]
    out[rows, cnt] = x & low
    out[rows, cnt + 1] = x >> sixteen
    cnt += STATE_WORDS
    # reverse every row's words: the state (written last) first, then the words in decoding order
    width = int(cnt.max()) if s else 0
    pos = np.arange(width)[None, :]  # [1, W]
    valid = pos < cnt[:, None]  # [S, W]
    src = np.where(valid, cnt[:, None] - 1 - pos, 0)
    return out[rows[:, None], src][valid], cnt


def encode_row(idx: list[int], ft: FreqTables) -> list[int]:
    """One row's stream (the words of :func:`encode`, in stream order) from its flat symbol indices
    ``table * alphabet + symbol`` (every one codable), in Python ints."""
    freq, cum, _ = ft.lists()
    x, out = L, []
    for i in reversed(idx):
        f = freq[i]
        if x >= f << (32 - PREC):
            out.append(x & 0xFFFF)
            x >>= 16
        x = ((x // f) << PREC) + x % f + cum[i]
    out += (x & 0xFFFF, x >> 16)
    out.reverse()
    return out


def decode_row(words: list[int], n: int, ft: FreqTables, next_table) -> list[int]:
    """One row's symbols (Python ints) from its stream ``words`` (the row's words of :func:`encode`):
    ``next_table(j, prev)`` gives the table of symbol ``j`` given symbol ``j - 1`` (None for j = 0), as
    :func:`decode_dynamic`'s callback does for one row. Raises :class:`RansError` as :func:`decode` does."""
    freq, cum, lookup = ft.lists()
    a, end = ft.alphabet, len(words)
    if end < STATE_WORDS:
        raise RansError(f"rans: a row of {end} words, shorter than its state")
    x, ptr = words[0] << 16 | words[1], STATE_WORDS
    if x < L:
        raise RansError(f"rans: a row starts in a state below {L}")
    out, sym = [], None
    for j in range(n):
        t = next_table(j, sym)
        slot = x & (M - 1)
        sym = lookup[t * M + slot]
        i = t * a + sym
        x = freq[i] * (x >> PREC) + slot - cum[i]
        if x < L:
            if ptr >= end:
                raise RansError(f"rans: a row's stream ends before its {n} symbols (truncated or altered)")
            x = x << 16 | words[ptr]
            ptr += 1
        out.append(sym)
    if ptr != end or x != L:
        raise RansError(f"rans: a row's stream does not decode to its {n} symbols (truncated or altered)")
    return out


def decode(stream: np.ndarray, lengths: np.ndarray, tables: np.ndarray, ft: FreqTables) -> np.ndarray:
    """Inverse of :func:`encode`: ``stream`` (uint16, the rows' words concatenated), ``lengths`` [S] (words
    per row), ``tables`` [S, n]. Returns symbols int64 [S, n]. Raises :class:`RansError` if a row's words do
    not decode to exactly ``n`` symbols ending in the initial state."""
    s, n = tables.shape
    if np.shape(lengths) != (s,):
        raise RansError(f"rans: {np.shape(lengths)} row lengths for {s} rows of tables")
    if s <= SCALAR_ROWS:
        lengths = check_lengths(stream, lengths)
        words, ends = stream.tolist(), np.cumsum(lengths).tolist()
        return np.array([decode_row(words[e - ln:e], n, ft, lambda j, prev, t=t: t[j])
                         for e, ln, t in zip(ends, lengths.tolist(), tables.tolist())], np.int64).reshape(s, n)
    return decode_dynamic(stream, lengths, n, ft, lambda j, prev: tables[:, j])


def check_lengths(stream: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``lengths`` as int64 [S]; :class:`RansError` unless they split ``stream`` into rows of >= the state."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.ndim != 1 or (lengths < STATE_WORDS).any() or int(lengths.sum()) != stream.size:
        raise RansError(f"rans: row lengths {lengths.shape} that do not split a stream of {stream.size} words")
    return lengths


def decode_dynamic(stream: np.ndarray, lengths: np.ndarray, n: int, ft: FreqTables, next_tables) -> np.ndarray:
    """:func:`decode` with tables chosen as the rows decode: ``next_tables(j, prev)`` returns the tables [S]
    of symbol ``j`` given the symbols ``prev`` [S] decoded at ``j - 1`` (None for ``j = 0``) - a context
    model whose state the caller keeps (the encoder, knowing every symbol, passes the same tables to
    :func:`encode`). Returns symbols int64 [S, n]; raises :class:`RansError` as :func:`decode` does."""
    lengths = check_lengths(stream, lengths)
    s = lengths.shape[0]
    out = np.empty((n, s), np.int64)
    if s == 0:
        return out.T
    words = stream.astype(np.uint64)
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # [S]
    end = first + lengths  # [S]
    x = (words[first] << np.uint64(16)) | words[first + 1]  # [S]
    if (x < L).any():  # the encoder's state never leaves [L, 2**32)
        raise RansError(f"rans: row {int(np.flatnonzero(x < L)[0])} starts in a state below {L}")
    ptr = first + STATE_WORDS
    last = stream.size - 1
    mask, prec = np.uint64(M - 1), np.uint64(PREC)
    sym = None
    for j in range(n):
        t = np.asarray(next_tables(j, sym), np.int64)  # [S]
        slot = x & mask
        sym = ft.lookup[t * M + slot.astype(np.int64)]
        k = t * ft.alphabet + sym
        x = ft._freq_flat[k].astype(np.uint64) * (x >> prec) + slot - ft._cum_flat[k].astype(np.uint64)
        need = x < L
        w = words[np.minimum(ptr, last)]  # a bad stream may run past its row: read in bounds, refuse below
        x = np.where(need, (x << np.uint64(16)) | w, x)
        ptr += need
        out[j] = sym
    if (ptr != end).any() or (x != L).any():
        bad = int(np.flatnonzero((ptr != end) | (x != L))[0])
        raise RansError(f"rans: row {bad}'s stream does not decode to its {n} symbols (truncated or altered)")
    return out.T
