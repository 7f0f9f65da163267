"""shared.codecs_pca_tcq: the trellis-coded PCA level - the state machine's levels, reconstruction error, byte
size against the scalar rANS level, raw rows, strict payload checks, mutation fuzzing, the artifact's level
round trip, the fit's table re-estimation. Generic PCA-codec checks (row independence, another basis, random
payloads, load_calibration) run for it in tests/shared/test_codecs_pca.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codecs_pca import H, _tensor, basis, states  # noqa: F401 (basis: the module's calibrated fixture)

from shared import codecs as C
from shared import protocol as P
from shared import rans
from shared.codecs_pca import CodecArtifactError, PcaBasis, calibrate_pca
from shared.codecs_pca_ans import RAW_ROW
from shared.codecs_pca_tcq import TRANSITIONS, TcqFit, TcqLevel, levels_of

NAME = "pca-tcq-compact"


@pytest.fixture(scope="module")
def codec(basis):  # noqa: F811
    return C.get_codec(NAME, basis=basis)


def test_the_two_quantizers_interleave_into_one_grid():
    k = np.arange(-3, 4)
    assert levels_of(k, np.zeros_like(k)).tolist() == [-6, -4, -2, 0, 2, 4, 6]
    assert levels_of(k, np.ones_like(k)).tolist() == [-5, -3, -1, 0, 1, 3, 5]
    # every state reaches one state of each quantizer: Q0 in states 0, 1 and Q1 in states 2, 3
    assert sorted((TRANSITIONS >> 1).sum(axis=1).tolist()) == [1, 1, 1, 1]


def test_reconstruction_error_is_bounded_on_the_sent_components(codec, basis):  # noqa: F811
    x = states(2, 200)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == np.float32
    a = basis.basis[:, :codec.r]
    err = ((y[1:].astype(np.float64) - x[1:]) @ a) / codec.step  # [S, r] in steps (of the union grid)
    assert np.sqrt((err ** 2).mean()) <= 1.0  # each quantizer's grid is 2 steps wide; the search picks its path
    assert np.abs(err).max() <= 4.0
    assert np.array_equal(y[0], x[0].astype(np.float16).astype(np.float32))  # the sink row travels whole


def test_fewer_bytes_or_less_error_than_the_scalar_level(basis):  # noqa: F811
    x = states(3, 400)[1:]
    a = basis.basis.astype(np.float64)
    out = {}
    for name in ("pca-ans-compact", NAME):
        c = C.get_codec(name, basis=basis)
        t = c.encode(x)
        out[name] = (len(t.data) / x.size, float((((c.decode(t) - x) @ a) ** 2).mean()))
    (b0, e0), (b1, e1) = out["pca-ans-compact"], out[NAME]
    assert b1 <= 1.15 * b0 and e1 <= 1.15 * e0 and (b1 < b0 or e1 < e0)  # same targets: near the same point


def test_far_rows_travel_whole_and_sizes_stay_within_the_bound(codec):
    x = states(4, 6)
    x[2] = 1e4
    t = codec.encode(x)
    classes = np.frombuffer(t.data[4:4 + 6], np.uint8)
    assert classes[2] == RAW_ROW and classes[0] == RAW_ROW and (classes[[1, 3, 4, 5]] < RAW_ROW).all()
    assert np.array_equal(codec.decode(t)[2], x[2])
    rng = np.random.default_rng(0)
    for scale in (0.1, 1, 30, 300):
        x = (states(5, 32) + rng.standard_normal((32, H)) * scale).astype(np.float32)
        t = codec.encode(x)
        assert len(t.data) <= codec.max_payload_bytes(32, H)
        assert codec.decode(t).shape == (32, H)
    assert codec.decode(codec.encode(np.zeros((0, H), np.float32))).shape == (0, H)


def test_truncated_extended_and_altered_payloads_are_refused(codec):
    x = states(6, 9)[1:]  # 8 coded rows
    data = codec.encode(x).data
    s = 8
    row_bytes = np.frombuffer(data[4:4 + s], np.uint8)
    assert (row_bytes != RAW_ROW).all()
    n_lo = int(codec.model.lo_bits_of[row_bytes & 31].sum())
    n_esc = int((row_bytes >> 5).sum())
    lengths_at = 4 + s + (n_lo + 7) // 8 + 2 * n_esc
    words_at = lengths_at + 2 * (s - 1)
    bad = [data[:-1], data + b"\0", data[:-2], data[:5], b"", data[:words_at]]
    for pos, mask in ((4, 0x7F), (lengths_at, 0x01), (words_at + 1, 0x10), (len(data) - 1, 0x01)):
        b = bytearray(data)
        b[pos] ^= mask  # a class out of range, a row length, a row's state, a renormalisation word
        bad.append(bytes(b))
    for b in bad:
        with pytest.raises(P.ProtocolError) as e:
            codec.decode(_tensor(codec, b, s))
        assert e.value.code == "bad_tensor"
    with pytest.raises(P.ProtocolError):
        codec.decode(_tensor(codec, data, s - 1))
    b = bytearray(data)  # a row byte claiming an escape its stream does not have
    b[4] = (b[4] & 31) | ((b[4] >> 5) + 1) << 5
    with pytest.raises(P.ProtocolError) as e:
        codec.decode(_tensor(codec, bytes(b[:lengths_at]) + b"\0\0" + bytes(b[lengths_at:]), s))
    assert e.value.code == "bad_tensor"


@pytest.mark.parametrize("s", [1, 3])
def test_few_rows_code_as_the_vectorised_path_and_refuse_damage(codec, monkeypatch, s):
    """A payload of at most rans.SCALAR_ROWS rows (a one-row DecodeStep) is searched and decoded row by row in
    Python numbers: the same bytes and values as the vectorised path, the same refusals."""
    x = states(11, s + 1)[1:]
    data = codec.encode(x).data
    assert len(data) <= codec.max_payload_bytes(s, H)
    y = codec.decode(_tensor(codec, data, s))
    row_bytes = np.frombuffer(data[4:4 + s], np.uint8)
    assert (row_bytes != RAW_ROW).all()
    n_lo = int(codec.model.lo_bits_of[row_bytes & 31].sum())
    lengths_at = 4 + s + (n_lo + 7) // 8 + 2 * int((row_bytes >> 5).sum())
    words_at = lengths_at + 2 * (s - 1)
    bad = [data[:-1], data + b"\0\0", data[:-2], data[:words_at + 2], data[:4 + s]]
    for pos, mask in ((4, 0x7F), (words_at + 1, 0x80), (words_at, 0x01), (len(data) - 1, 0x01)):
        b = bytearray(data)
        b[pos] ^= mask  # a class out of range, the first row's state (high and low bits), the last word
        bad.append(bytes(b))
    b = bytearray(data)  # a row byte claiming an escape its stream does not have
    b[4] = (b[4] & 31) | ((b[4] >> 5) + 1) << 5
    bad.append(bytes(b[:lengths_at]) + b"\0\0" + bytes(b[lengths_at:]))
    for vectorised in (False, True):
        if vectorised:
            monkeypatch.setattr(rans, "SCALAR_ROWS", 0)
            assert codec.encode(x).data == data
        assert np.array_equal(codec.decode(_tensor(codec, data, s)), y)
        for b in bad:
            with pytest.raises(P.ProtocolError) as e:
                codec.decode(_tensor(codec, b, s))
            assert e.value.code == "bad_tensor"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 32 - 1), s=st.integers(1, 5), flips=st.integers(1, 4), cut=st.integers(0, 3))
def test_mutated_payloads_decode_or_refuse(codec, seed, s, flips, cut):
    rng = np.random.default_rng(seed)
    data = bytearray(codec.encode(states(seed % 97, s)).data)
    for _ in range(flips):
        data[int(rng.integers(4, len(data)))] ^= 1 << int(rng.integers(0, 8))
    payload = bytes(data[:len(data) - cut])
    try:
        y = codec.decode(_tensor(codec, payload, s))
    except P.ProtocolError as e:
        assert e.code == "bad_tensor"
        return
    assert y.shape == (s, H) and np.isfinite(y).all()


def test_artifact_keeps_the_level_and_refuses_broken_tables(basis):  # noqa: F811
    again = PcaBasis.from_bytes(basis.to_bytes())
    lv, lv2 = basis.levels[NAME], again.levels[NAME]
    assert again.digest == basis.digest and isinstance(lv2, TcqLevel)
    assert all(np.array_equal(lv.arrays()[k], lv2.arrays()[k]) for k in TcqLevel.FIELDS)
    with np.load(io.BytesIO(basis.to_bytes())) as z:
        arrays = {k: z[k] for k in z.files}
    sums = dict(arrays)
    sums[f"{NAME}.freq"] = arrays[f"{NAME}.freq"].copy()
    sums[f"{NAME}.freq"][0, 0] += 1  # no longer sums to M
    bits = dict(arrays)
    bits[f"{NAME}.shift"] = arrays[f"{NAME}.shift"].copy()
    g = bits[f"{NAME}.shift"].size // 2
    bits[f"{NAME}.shift"][g:] = (bits[f"{NAME}.shift"][g:] + 1) % 3  # Q1's raw bits differ from Q0's
    missing = {k: v for k, v in arrays.items() if k != f"{NAME}.lam"}
    for arr in (sums, bits, missing):
        buf = io.BytesIO()
        np.savez(buf, **arr)
        with pytest.raises(CodecArtifactError):
            PcaBasis.from_bytes(buf.getvalue())


def test_the_fit_follows_its_options():
    x = states(0, 1500)
    coarse = calibrate_pca(x, {NAME: 0.2}).levels[NAME]
    fine = calibrate_pca(x, {NAME: 0.4}, tcq=TcqFit(classes=4, refine=0)).levels[NAME]
    assert coarse.step > fine.step and fine.class_log2_gain.size == 4
    assert (fine.freq[:fine.freq.shape[0] // 2] == fine.freq[fine.freq.shape[0] // 2:]).all()  # not re-estimated
    assert (coarse.freq.astype(np.int64).sum(axis=1) == rans.M).all()


def test_decoding_in_blocks_matches_single_rows(codec):
    x = states(10, 600)
    y = codec.decode(codec.encode(x))
    picks = [0, 255, 256, 257, 511, 512, 599]
    assert np.array_equal(np.concatenate([codec.decode(codec.encode(x[i:i + 1])) for i in picks]), y[picks])


def test_rans_dynamic_tables_match_static_ones():
    rng = np.random.default_rng(1)
    freq = np.stack([np.full(8, rans.M // 8), np.array([rans.M - 7] + [1] * 7)]).astype(np.int64)
    ft = rans.FreqTables(freq)
    tables = rng.integers(0, 2, (5, 30))
    sym = np.where(tables == 1, 0, rng.integers(0, 8, (5, 30)))
    words, lengths = rans.encode(sym, tables, ft)
    seen = []

    def pick(j, prev):
        seen.append(prev is None if j == 0 else prev.tolist() == sym[:, j - 1].tolist())
        return tables[:, j]

    assert np.array_equal(rans.decode_dynamic(words, lengths, 30, ft, pick), sym) and all(seen)
    with pytest.raises(rans.RansError):
        rans.decode_dynamic(words[:-1], lengths - np.eye(5, dtype=np.int64)[4], 30, ft, pick)
