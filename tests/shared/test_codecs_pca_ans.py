"""shared.codecs_pca_ans: the rANS-coded PCA level - reconstruction error, raw rows, strict payload checks,
mutation fuzzing, the artifact's level round trip. Generic PCA-codec checks (row independence, another
basis, random payloads, load_calibration) run for it in tests/shared/test_codecs_pca.py."""

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
from shared.codecs_pca_ans import RAW_ROW, AnsFit, AnsLevel, gg_tables, quantize_freq

NAME = "pca-ans-compact"


@pytest.fixture(scope="module")
def codec(basis):  # noqa: F811
    return C.get_codec(NAME, basis=basis)


def test_reconstruction_error_is_bounded_on_the_sent_components(codec, basis):  # noqa: F811
    x = states(2, 200)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == np.float32
    a = basis.basis[:, :codec.r]
    err = ((y[1:].astype(np.float64) - x[1:]) @ a) / codec.step  # [S, r] in steps
    assert np.abs(err).max() <= 2.0  # rounding (1/2), the centroid shrink (< 1/2), a rate-optimised step (1)
    assert np.sqrt((err ** 2).mean()) <= 0.5
    assert np.array_equal(y[0], x[0].astype(np.float16).astype(np.float32))  # the sink row travels whole


def test_far_rows_travel_whole_and_sizes_stay_within_the_bound(codec):
    x = states(4, 6)
    x[2] = 1e4  # far outside every table
    t = codec.encode(x)
    classes = np.frombuffer(t.data[4:4 + 6], np.uint8)
    assert classes[2] == RAW_ROW and classes[0] == RAW_ROW and (classes[[1, 3, 4, 5]] < RAW_ROW).all()
    assert np.array_equal(codec.decode(t)[2], x[2])
    rng = np.random.default_rng(0)
    for scale in (0.1, 1, 30, 300):  # from all-zero codes to rows at the edge of the tables
        x = (states(5, 32) + rng.standard_normal((32, H)) * scale).astype(np.float32)
        assert len(codec.encode(x).data) <= codec.max_payload_bytes(32, H)
    assert codec.decode(codec.encode(np.zeros((0, H), np.float32))).shape == (0, H)


def test_truncated_extended_and_altered_payloads_are_refused(codec):
    x = states(6, 9)[1:]  # 8 coded rows
    data = codec.encode(x).data
    s = 8
    n_lo = int(codec.model.lo_bits_of[np.frombuffer(data[4:4 + s], np.uint8)].sum())
    lengths_at = 4 + s + (n_lo + 7) // 8
    words_at = lengths_at + 2 * (s - 1)
    bad = [data[:-1], data + b"\0", data[:-2], data[:5], b"", data[:words_at]]
    for pos, mask in ((4, 0x7F), (lengths_at, 0x01), (words_at + 1, 0x10), (len(data) - 1, 0x01)):
        b = bytearray(data)
        b[pos] ^= mask  # a class out of range, a row length, a row's state, a renormalisation word
        bad.append(bytes(b))
    if n_lo % 8:
        b = bytearray(data)
        b[lengths_at - 1] |= 0x80  # a padding bit of the raw low bits
        bad.append(bytes(b))
    for b in bad:
        with pytest.raises(P.ProtocolError) as e:
            codec.decode(_tensor(codec, b, s))
        assert e.value.code == "bad_tensor"
    with pytest.raises(P.ProtocolError):
        codec.decode(_tensor(codec, data, s - 1))  # the same bytes declared as another shape


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 32 - 1), s=st.integers(1, 5), flips=st.integers(1, 4), cut=st.integers(0, 3))
def test_mutated_payloads_decode_or_refuse(codec, seed, s, flips, cut):
    rng = np.random.default_rng(seed)
    data = bytearray(codec.encode(states(seed % 97, s)).data)
    for _ in range(flips):
        data[int(rng.integers(4, len(data)))] ^= 1 << int(rng.integers(0, 8))  # past the fingerprint
    payload = bytes(data[:len(data) - cut])
    try:
        y = codec.decode(_tensor(codec, payload, s))
    except P.ProtocolError as e:
        assert e.code == "bad_tensor"
        return
    assert y.shape == (s, H) and np.isfinite(y).all()


def test_artifact_keeps_the_level_and_refuses_broken_tables(basis, tmp_path):  # noqa: F811
    again = PcaBasis.from_bytes(basis.to_bytes())
    lv, lv2 = basis.levels[NAME], again.levels[NAME]
    assert again.digest == basis.digest and isinstance(lv2, AnsLevel)
    assert all(np.array_equal(lv.arrays()[k], lv2.arrays()[k]) for k in AnsLevel.FIELDS)
    with np.load(io.BytesIO(basis.to_bytes())) as z:
        arrays = {k: z[k] for k in z.files}
    broken = dict(arrays)
    broken[f"{NAME}.freq"] = arrays[f"{NAME}.freq"].copy()
    broken[f"{NAME}.freq"][0, 0] += 1  # no longer sums to M
    missing = {k: v for k, v in arrays.items() if k != f"{NAME}.shrink"}
    old = {k: v for k, v in arrays.items() if not k.startswith(NAME)}
    old["version"] = np.array([1], np.int32)  # a version-1 artifact (Rice levels only) still loads
    for arr, ok in ((broken, False), (missing, False), (old, True)):
        buf = io.BytesIO()
        np.savez(buf, **arr)
        if ok:
            assert NAME not in PcaBasis.from_bytes(buf.getvalue()).levels
        else:
            with pytest.raises(CodecArtifactError):
                PcaBasis.from_bytes(buf.getvalue())


def test_tables_are_exact_distributions_and_the_fit_follows_its_options():
    log2_tau, freq, shift, shrink = gg_tables(1.5)
    assert (freq.astype(np.int64).sum(1) == rans.M).all() and (np.diff(shift.astype(int)) >= 0).all()
    assert (shrink >= 0).all() and (shrink < 0.5 + 1e-9).all() and shrink[-1] < shrink[log2_tau.size // 3]
    assert quantize_freq(np.array([0.0, 1e-9, 0.5, 0.5])).tolist()[:2] == [0, 1]
    x = states(0, 1500)
    coarse = calibrate_pca(x, {NAME: 0.2}).levels[NAME]
    fine = calibrate_pca(x, {NAME: 0.4}, ans=AnsFit(classes=4, folds=0)).levels[NAME]
    assert coarse.step > fine.step and fine.class_log2_gain.size == 4


def test_decoding_in_blocks_and_the_decoded_size_bound(codec):
    x = states(10, 600)  # more rows than one decoding block
    t = codec.encode(x)
    y = codec.decode(t)
    picks = [0, 255, 256, 257, 511, 512, 599]
    assert np.array_equal(np.concatenate([codec.decode(codec.encode(x[i:i + 1])) for i in picks]), y[picks])
    with pytest.raises(P.ProtocolError) as e:  # 5 payload bytes could claim a whole float32 row each
        codec.decode(t, P.Limits(max_decoded_tensor_bytes=4 * 600 * H - 1))
    assert e.value.code == "bad_tensor" and "decodes to more than" in str(e.value)
