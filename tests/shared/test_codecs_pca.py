"""shared.codecs_pca: calibration, round trips within the step, strict payload validation, the artifact's checks."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec_fuzz

from shared import codecs as C
from shared import protocol as P
from shared.codecs_pca import LEVELS, U_MAX, CodecArtifactError, PcaBasis, calibrate_pca

H = 48
TARGETS = {"pca-fine": 0.62, "pca-compact": 0.25, "pca-ans-compact": 0.3, "pca-tcq-compact": 0.3}  # every level of the artifact


def states(seed: int, t: int) -> np.ndarray:
    """Activation-like rows [t, H]: a few strong directions, a massive channel, a sink row first."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(99).standard_normal((8, H))  # the same directions for every seed
    x = rng.standard_normal((t, 8)) @ mix * 3 + rng.standard_normal((t, H)) * 0.3
    x[:, 5] += 200.0
    x[0] *= 40  # the attention sink
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def basis() -> PcaBasis:
    return calibrate_pca(states(0, 2000), TARGETS)


@pytest.fixture(scope="module", params=LEVELS)
def codec(request, basis):
    """The Rice-coded levels (their layout; the rANS level: tests/shared/test_codecs_pca_ans.py)."""
    return C.get_codec(request.param, basis=basis)


@pytest.fixture(scope="module", params=C.BASIS_CODECS)
def any_codec(request, basis):
    return C.get_codec(request.param, basis=basis)


def test_calibration_orders_components_and_reaches_the_byte_targets(basis):
    assert np.allclose(basis.basis.T @ basis.basis, np.eye(H), atol=1e-4)
    fine, compact = basis.levels["pca-fine"], basis.levels["pca-compact"]
    assert compact.step > fine.step and compact.r <= fine.r
    for name, target in TARGETS.items():
        c = C.get_codec(name, basis=basis)
        x = states(1, 512)[1:]  # held-out rows, no sink
        assert abs(len(c.encode(x).data) / x.size - target) < 0.15 * target + 0.02


def test_round_trip_error_is_within_half_a_step_per_sent_component(codec, basis):
    x = states(2, 64)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.array_equal(y[0], x[0].astype(np.float16).astype(np.float32))  # the sink row, whole in float16
    a = basis.basis[:, :codec.r]
    err = (y[1:].astype(np.float64) - x[1:]) @ a  # [S, r] error of the sent coefficients
    assert np.abs(err).max() <= codec.step / 2 + 1e-3
    z = codec.encode(x, zstd=True)
    assert np.array_equal(codec.decode(P.decode_message(P.encode_message(
        P.Prefill(request_id="r", start=0, hidden=z))).hidden), y)


def test_rows_are_coded_independently(any_codec):
    codec = any_codec
    x = states(3, 40)
    whole = codec.decode(codec.encode(x))
    rows = np.concatenate([codec.decode(codec.encode(x[i:i + 1])) for i in range(40)])
    assert np.array_equal(whole, rows)
    assert np.array_equal(codec.decode_rows([codec.encode(x[i:i + 1]) for i in range(1, 6)]), whole[1:6])


def test_far_rows_travel_whole_and_empty_tensors_work(codec):
    x = states(4, 3)
    x[2] = 1e4  # far outside the calibration: its Rice quotients exceed U_MAX
    t = codec.encode(x)
    assert t.data[4] & 0b100  # flagged in the bitmap (after the 4-byte fingerprint)
    assert np.array_equal(codec.decode(t)[2], x[2])
    e = codec.encode(np.zeros((0, H), np.float32))
    assert codec.decode(e).shape == (0, H)


def _tensor(codec, data: bytes, s: int) -> P.EncodedTensor:
    return P.EncodedTensor(codec=codec.name, shape=(s, H), data=data)


def test_decode_refuses_truncated_extended_and_altered_payloads(codec):
    x = states(5, 6)[1:]
    data = codec.encode(x).data
    for bad in (data[:-1], data + b"\0", data[:9], b""):
        with pytest.raises(P.ProtocolError) as e:
            codec.decode(_tensor(codec, bad, 5))
        assert e.value.code == "bad_tensor"
    unary_len = int(np.frombuffer(data[5:9], "<i4")[0])
    wrong_count = bytearray(data)
    wrong_count[9] ^= 0x01  # a terminator more or less in the unary field
    padded = bytearray(data)
    padded[-1] |= 0x80  # a padding bit of the sign field (5 rows leave some)
    longer = bytearray(data)
    longer[5:9] = np.int32(unary_len + 1).astype("<i4").tobytes()  # the unary field claims one byte more
    negative = bytearray(data)
    negative[5:9] = np.int32(-1).astype("<i4").tobytes()
    for bad in (wrong_count, longer, negative):
        with pytest.raises(P.ProtocolError):
            codec.decode(_tensor(codec, bytes(bad), 5))
    if (bin(int.from_bytes(data[-1:], "little")).count("1") < 8):
        with pytest.raises(P.ProtocolError):
            codec.decode(_tensor(codec, bytes(padded), 5))
    with pytest.raises(P.ProtocolError):
        codec.decode(_tensor(codec, data, 4))  # the same bytes declared as another shape


def test_decode_refuses_an_oversized_quotient(codec):
    ones = bytearray(codec.encode(states(6, 2)[1:]).data)
    zeros = np.zeros(U_MAX + 1, np.uint8)  # U_MAX + 1 zeros then the terminator: one quotient too large
    unary = np.packbits(np.concatenate([zeros, [1], np.ones(codec.r - 1, np.uint8)]), bitorder="little").tobytes()
    bad = bytes(ones[:5]) + np.int32(len(unary)).astype("<i4").tobytes() + unary + bytes(64)
    with pytest.raises(P.ProtocolError):
        codec.decode(_tensor(codec, bad, 1))


def test_another_basis_is_refused_not_decoded(any_codec, basis):
    codec = any_codec
    other = calibrate_pca(states(7, 2000) * 1.5, TARGETS)
    t = C.get_codec(codec.name, basis=other).encode(states(8, 4))
    with pytest.raises(P.ProtocolError) as e:
        codec.decode(t)
    assert e.value.code == "bad_codec" and "artifact" in str(e.value)
    with pytest.raises(P.ProtocolError):
        codec.decode(P.EncodedTensor(codec=codec.name, shape=(4, H + 1), data=t.data))  # another model's width
    with pytest.raises(P.ProtocolError):
        codec.encode(np.zeros((2, H + 1), np.float32))


@pytest.mark.parametrize("name", C.BASIS_CODECS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), s=st.integers(0, 4), keep=st.booleans())
def test_random_payloads_decode_or_refuse(name, basis, data, s, keep):
    c = C.get_codec(name, basis=basis)
    payload = (c.fingerprint + data) if keep else data  # past the fingerprint check, or not
    try:
        y = c.decode(_tensor(c, payload, s))
    except P.ProtocolError:
        return
    assert y.shape == (s, H) and np.isfinite(y).all()


def test_fuzzed_payloads_decode_or_refuse(basis):
    """tests/shared/codec_fuzz.py over the four PCA codecs (Rice, rANS, trellis): bit flips, truncations, length
    fields, corrupted rANS words, zstd bombs... each decodes to finite float32 of its shape or is refused with a
    documented code, within 1 s and bounded memory."""
    codecs = {name: C.get_codec(name, basis=basis) for name in C.BASIS_CODECS}
    report = codec_fuzz.fuzz(codecs, 144, seed=3, h=H)
    assert report["n_failures"] == 0, report["failures"]


@pytest.mark.slow
def test_one_hundred_thousand_fuzzed_payloads_of_every_codec(basis):
    report = codec_fuzz.fuzz(C.available_codecs({"outlier_channels": [3, 17, 40], "sink_threshold": 30.0,
                                                 "pca_basis": basis}), 100_000, seed=0, h=H)
    assert report["n_failures"] == 0, report["failures"]


def test_encode_refuses_nan_and_get_codec_checks_parameters(basis):
    c = C.get_codec("pca-fine", basis=basis)
    x = states(9, 2)
    x[1, 3] = np.nan
    with pytest.raises(P.ProtocolError):
        c.encode(x)
    for params in ({}, {"basis": "codec_pca.npz"}, {"basis": basis, "outlier_channels": [1]}):
        with pytest.raises(P.ProtocolError) as e:
            C.get_codec("pca-compact", **params)
        assert e.value.code == "bad_codec"


def test_artifact_round_trip_and_hash_check(basis, tmp_path):
    path = tmp_path / "codec_pca.npz"
    basis.save(path)
    again = PcaBasis.load(path, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    assert again.digest == basis.digest
    with pytest.raises(CodecArtifactError):
        PcaBasis.load(path, sha256="0" * 64)
    with pytest.raises(CodecArtifactError):
        PcaBasis.from_bytes(b"not a zip file")
    with pytest.raises(CodecArtifactError):
        PcaBasis.load(tmp_path / "missing.npz")


def test_a_malformed_artifact_leaves_the_pca_codecs_out_instead_of_raising(basis, tmp_path):
    """An artifact whose arrays have the wrong kind or shape (its sha256 matching, as a hand-made or broken bundle
    has) is a CodecArtifactError, so load_calibration reports it (pca_error) and offers the other codecs; a table
    without columns raised IndexError and strings in the mean ValueError, out of load_calibration."""
    with np.load(io.BytesIO(basis.to_bytes())) as z:
        arrays = {k: z[k] for k in z.files}
    cases = [("mean", np.array(["a"] * H))]
    cases += [(f"{name}.freq", np.zeros((arrays[f"{name}.freq"].shape[0], 0), np.uint16))
              for name in ("pca-ans-compact", "pca-tcq-compact")]
    for key, value in cases:
        buf = io.BytesIO()
        np.savez(buf, **{**arrays, key: value})
        (tmp_path / "codec_pca.npz").write_bytes(buf.getvalue())
        (tmp_path / "calibration.json").write_text(json.dumps({"outlier_channels": [5], "pca_codec": {
            "file": "codec_pca.npz", "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}}))
        calib = C.load_calibration(tmp_path)
        assert calib["pca_error"].startswith("pca basis:"), key
        assert "int8-outlier" in C.available_codecs(calib) and not set(C.BASIS_CODECS) & set(C.available_codecs(calib))


def test_load_calibration_offers_pca_codecs_only_with_the_artifact(basis, tmp_path):
    basis.save(tmp_path / "codec_pca.npz")
    sha = hashlib.sha256((tmp_path / "codec_pca.npz").read_bytes()).hexdigest()
    (tmp_path / "calibration.json").write_text(json.dumps(
        {"outlier_channels": [5], "pca_codec": {"file": "codec_pca.npz", "sha256": sha}}))
    have = C.available_codecs(C.load_calibration(tmp_path))
    assert set(C.BASIS_CODECS) <= set(have) and "int8-outlier" in have
    (tmp_path / "codec_pca.npz").write_bytes(b"tampered")
    calib = C.load_calibration(tmp_path)
    assert "sha256" in calib["pca_error"]
    assert not set(C.BASIS_CODECS) & set(C.available_codecs(calib))
    assert C.load_calibration(tmp_path / "nowhere") is None
