"""shared.rans: row-parallel rANS round trips, per-row independence, code length, refusal of bad streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import rans


def tables(seed: int, g: int = 4, a: int = 12) -> rans.FreqTables:
    """``g`` skewed distributions over ``a`` symbols, one with unused (frequency 0) symbols."""
    p = np.random.default_rng(seed).random((g, a)) ** 4
    p[0, a // 2:] = 0
    f = np.where(p > 0, np.maximum(1, np.floor(p / p.sum(1, keepdims=True) * rans.M)), 0).astype(np.int64)
    f[np.arange(g), f.argmax(1)] += rans.M - f.sum(1)
    return rans.FreqTables(f)


def draw(ft: rans.FreqTables, seed: int, s: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Symbols [s, n] drawn from their tables [s, n]."""
    rng = np.random.default_rng(seed)
    tab = rng.integers(0, ft.freq.shape[0], (s, n))
    cdf = np.cumsum(ft.freq, axis=1)[tab]  # [s, n, A]
    sym = (rng.integers(0, rans.M, (s, n))[..., None] >= cdf).sum(-1)
    return sym, tab


def test_round_trip_and_code_length_near_the_entropy():
    ft = tables(0)
    sym, tab = draw(ft, 1, 64, 300)
    assert ft.codable(sym, tab).all()
    words, lengths = rans.encode(sym, tab, ft)
    assert words.dtype == np.uint16 and lengths.sum() == words.size and (lengths >= rans.STATE_WORDS).all()
    assert np.array_equal(rans.decode(words, lengths, tab, ft), sym)
    ideal = (rans.PREC - np.log2(ft.freq[tab, sym])).sum()  # bits
    assert ideal <= 16 * words.size <= ideal + 64 * (16 * rans.STATE_WORDS + 16)  # the state and a word per row


def test_rows_are_independent_and_empty_inputs_work():
    ft = tables(2)
    sym, tab = draw(ft, 3, 10, 50)
    words, lengths = rans.encode(sym, tab, ft)
    start = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(10):
        w1, l1 = rans.encode(sym[i:i + 1], tab[i:i + 1], ft)
        assert np.array_equal(w1, words[start[i]:start[i + 1]]) and l1[0] == lengths[i]
    w0, l0 = rans.encode(np.zeros((0, 5), np.int64), np.zeros((0, 5), np.int64), ft)
    assert w0.size == 0 and rans.decode(w0, l0, np.zeros((0, 5), np.int64), ft).shape == (0, 5)
    w, ln = rans.encode(np.zeros((3, 0), np.int64), np.zeros((3, 0), np.int64), ft)  # no symbols: the state only
    assert list(ln) == [rans.STATE_WORDS] * 3 and rans.decode(w, ln, np.zeros((3, 0), np.int64), ft).shape == (3, 0)


def test_bad_streams_and_tables_are_refused():
    ft = tables(4)
    sym, tab = draw(ft, 5, 3, 40)
    words, lengths = rans.encode(sym, tab, ft)
    shorter = lengths.copy()
    shorter[-1] -= 1
    moved = lengths + np.array([1, -1, 0])  # a word of row 1 read as row 0's
    tiny = np.array([1, lengths[0] + lengths[1] - 1, lengths[2]])  # a row shorter than its state
    for w, ln in ((words[:-1], shorter), (words, moved), (words, tiny)):
        with pytest.raises(rans.RansError):
            rans.decode(w, ln, tab, ft)
    with pytest.raises(rans.RansError):
        rans.decode(words, lengths[:2], tab, ft)  # lengths that do not cover the stream
    altered = words.copy()
    altered[lengths[0] + 1] ^= 0x0100  # the second row's initial state
    with pytest.raises(rans.RansError):
        rans.decode(altered, lengths, tab, ft)
    unused = np.full((1, 1), ft.alphabet - 1)  # table 0 has no frequency for its upper half
    assert not ft.codable(unused, np.zeros((1, 1), np.int64)).any()
    with pytest.raises(ValueError):
        rans.encode(unused, np.zeros((1, 1), np.int64), ft)
    for bad in (np.full((2, 3), 1000), np.array([[rans.M + 1, -1]]), np.ones((2, 2), np.float32) * rans.M / 2):
        with pytest.raises(ValueError):
            rans.FreqTables(bad)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=80), s=st.integers(1, 3), n=st.integers(0, 12))
def test_random_streams_decode_or_refuse(data, s, n):
    ft = tables(6)
    words = np.frombuffer(data[:len(data) // 2 * 2], "<u2")
    cut = np.sort(np.random.default_rng(len(data)).integers(0, words.size + 1, s - 1))
    lengths = np.diff(np.concatenate([[0], cut, [words.size]]))
    tab = np.zeros((s, n), np.int64) + np.arange(n) % ft.freq.shape[0]
    try:
        sym = rans.decode(words, lengths, tab, ft)
    except rans.RansError:
        return
    assert sym.shape == (s, n) and ft.codable(sym, tab).all()
    w2, l2 = rans.encode(sym, tab, ft)  # what decodes cleanly is exactly what the encoder writes
    assert np.array_equal(w2, words) and np.array_equal(l2, lengths)


def test_row_coders_write_and_read_the_vectorised_streams(monkeypatch):
    """At most SCALAR_ROWS rows are coded row by row in Python ints: the same words, the same refusals."""
    ft = tables(6)
    sym, tab = draw(ft, 7, rans.SCALAR_ROWS, 80)
    words, lengths = rans.encode(sym, tab, ft)  # row by row
    first = int(lengths[0])
    bad = [(words[:-1], lengths - np.eye(lengths.size, dtype=np.int64)[-1]),  # truncated
           (np.append(words, 7).astype(np.uint16), lengths + np.eye(lengths.size, dtype=np.int64)[-1]),  # extended
           (words, np.concatenate([[1], [lengths[0] + lengths[1] - 1], lengths[2:]]))]  # a row shorter than its state
    for at, mask in ((0, 0xFF00), (1, 0x0101), (first - 1, 0x0010)):  # row 0's state and its last word
        w = words.copy()
        w[at] ^= mask
        bad.append((w, lengths))
    for vectorised in (False, True):
        if vectorised:
            monkeypatch.setattr(rans, "SCALAR_ROWS", 0)
            w2, l2 = rans.encode(sym, tab, ft)
            assert np.array_equal(w2, words) and np.array_equal(l2, lengths)
        assert np.array_equal(rans.decode(words, lengths, tab, ft), sym)
        for w, ln in bad:
            with pytest.raises(rans.RansError):
                rans.decode(w, ln, tab, ft)
