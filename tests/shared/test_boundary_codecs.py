"""shared.codecs: round trips within each codec's error bound, exact layouts, strict payload validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import codec_fuzz

from shared import codecs as C
from shared import protocol as P
from shared.codecs_outlier import hadamard, rotation_signs

CALIB = {"outlier_channels": [3, 17, 40], "sink_threshold": 30.0}
NAMES = [n for n in C.CODEC_NAMES if n not in C.BASIS_CODECS]  # the PCA codecs: tests/shared/test_codecs_pca.py


def codec(name: str):
    return C.available_codecs(CALIB)[name]


def hidden(seed=0, s=9, h=64, massive=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s, h)).astype(np.float32)
    if massive:
        x[:, 17] *= 300  # a massive-activation channel
        x[0] *= 25  # an attention sink
    return x


def max_rel_err(name, x, y):
    """Error relative to each row's scale (what the codec promises)."""
    return float((np.abs(y - x).max(axis=1) / np.maximum(np.abs(x).max(axis=1), 1e-30)).max())


BOUNDS = {"fp32": 0.0, "fp16": 1e-3, "bf16": 8e-3, "int8-b32": 1e-2, "int8-b64": 1e-2, "int4-b32": 0.15,
          "int8-outlier": 1e-2, "int4-outlier": 0.15}

finite_rows = hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 70)),  # within float16's range
                         elements=st.floats(-6e4, 6e4, width=32, allow_nan=False, allow_infinity=False))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=finite_rows, z=st.booleans())
def test_round_trip_any_finite_input(name, x, z):
    h = x.shape[1]
    c = C.get_codec(name, outlier_channels=[0, h - 1] if h > 2 else [0]) if name in C.OUTLIER_CODECS else \
        C.get_codec(name)
    if name in C.OUTLIER_CODECS and h < 2:
        with pytest.raises(P.ProtocolError):
            c.encode(x)
        return
    t = c.encode(x, zstd=z)
    assert t.shape == x.shape and t.codec == name
    frame = P.encode_message(P.Prefill(request_id="r", start=0, hidden=t))  # through the wire too
    y = c.decode(P.decode_message(frame).hidden)
    assert y.shape == x.shape and y.dtype == np.float32 and np.isfinite(y).all()
    if name == "int4-outlier":  # rotated blocks: the error bound is on each block's L2 norm
        err, ref = np.linalg.norm(y - x, axis=1), np.linalg.norm(x, axis=1)
        assert (err <= 0.25 * ref + 1e-3).all()
    else:
        scale = np.maximum(np.abs(x).max(), 1e-3)
        tol = {"fp32": 0.0, "fp16": 1e-3, "bf16": 8e-3}.get(name, 0.1 if "int4" in name else 0.01)
        assert np.abs(y - x).max() <= tol * scale + 1e-3
    assert c.decode(c.encode(y)).shape == x.shape


@pytest.mark.parametrize("name", NAMES)
def test_error_bounds_on_activation_like_data(name):
    x = hidden()
    c = codec(name)
    y = c.decode(c.encode(x))
    assert max_rel_err(name, x, y) <= BOUNDS[name]
    if name == "fp32":  # the lossless one: bit for bit
        assert np.array_equal(y, x)
    if name in C.OUTLIER_CODECS:  # outlier channels and the sink row are float16-exact
        f16 = x.astype(np.float16).astype(np.float32)
        assert np.array_equal(y[:, CALIB["outlier_channels"]], f16[:, CALIB["outlier_channels"]])
        assert np.array_equal(y[0], f16[0])


@pytest.mark.parametrize("name", NAMES)
def test_rows_are_coded_independently(name):
    """Quality measured on prefill chunks holds for single-token decode messages (bench relies on it)."""
    x = hidden(1, s=6)
    c = codec(name)
    whole = c.decode(c.encode(x))
    rows = np.concatenate([c.decode(c.encode(x[i:i + 1])) for i in range(6)])
    assert np.array_equal(whole, rows)


@pytest.mark.parametrize("name", NAMES)
def test_decode_rows_equals_decoding_each_row(name):
    """decode_rows (a decode step's rows in one pass) gives exactly what decode gives row by row, sink rows and
    zstd included (those take the one-by-one path)."""
    c = codec(name)
    x = hidden(2, s=7)  # row 0 is a sink row for the outlier codecs
    ts = [c.encode(x[i:i + 1], zstd=(i == 3)) for i in range(7)]
    rows = c.decode_rows(ts)
    assert rows.shape == (7, 64) and rows.dtype == np.float32
    assert np.array_equal(rows, np.concatenate([c.decode(t) for t in ts]))
    plain = ts[1:3] + ts[4:]  # no sink, no zstd: the outlier codecs' one-pass layout
    for n in range(1, len(plain) + 1):  # int8-outlier: a gather for a few rows, channel runs for more
        assert np.array_equal(c.decode_rows(plain[:n]), np.concatenate([c.decode(t) for t in plain[:n]]))


@pytest.mark.parametrize("name", ["int8-outlier", "int4-outlier", "bf16"])
def test_decode_rows_refuses_a_bad_row_among_good_ones(name):
    c = codec(name)
    ts = [c.encode(hidden(3 + i, s=1, massive=False)) for i in range(4)]
    bad = bytearray(ts[2].data)
    if name == "int8-outlier":
        bad[1 + 2 * len(CALIB["outlier_channels"]) + 2] = 0x80  # code -128 in the rest
    elif name == "int4-outlier":
        bad[0] |= 0x02  # bitmap padding bit of a one-row tensor
    else:
        bad = bad[:-1]  # one byte short
    ts[2] = P.EncodedTensor(codec=name, shape=(1, 64), data=bytes(bad))
    with pytest.raises(P.ProtocolError):
        c.decode_rows(ts)
    with pytest.raises(P.ProtocolError):
        c.decode_rows([ts[0], c.encode(hidden(9, s=2))])  # a two-row tensor is not a decode-step row
    with pytest.raises(ValueError):
        c.decode_rows([])


@pytest.mark.parametrize("bits", [0x7C00, 0xFC00, 0x7E00, 0xFFFF])  # +Inf, -Inf, NaN, a negative NaN
def test_fp16_rows_in_one_pass_refuse_inf_and_nan(bits):
    c = codec("fp16")
    ts = [c.encode(hidden(20 + i, s=1, massive=False)) for i in range(5)]
    half = c.half_rows(ts)
    assert half.dtype == np.float16 and half.flags.writeable  # the cloud widens it in place of numpy
    assert np.array_equal(half.astype(np.float32), np.concatenate([c.decode(t) for t in ts]))
    bad = bytearray(ts[3].data)
    bad[2 * 7:2 * 7 + 2] = bits.to_bytes(2, "little")  # channel 7 of row 3
    ts[3] = P.EncodedTensor(codec="fp16", shape=(1, 64), data=bytes(bad))
    for decode in (c.half_rows, c.decode_rows, lambda rows: c.decode(rows[3])):
        with pytest.raises(P.ProtocolError, match="NaN or Inf"):
            decode(ts)
    assert c.half_rows([ts[0], c.encode(hidden(9, s=2))]) is None  # not a decode step's row: decode_rows' job
    packed = c.encode(np.zeros((1, 64), np.float32), zstd=True)
    assert packed.zstd and c.half_rows([packed]) is None


@pytest.mark.parametrize("name", NAMES)
def test_payload_sizes(name):
    c = codec(name)
    x = hidden(2, s=5, h=64, massive=False)  # no sink rows
    t = c.encode(x)
    assert len(t.data) == c.payload_bytes(5, 64) <= c.max_payload_bytes(5, 64)
    if name in C.OUTLIER_CODECS:
        xs = x.copy()
        xs[:, 0] = 1000.0  # every row a sink
        assert len(c.encode(xs).data) == c.max_payload_bytes(5, 64)


def test_nominal_bytes_per_element():
    h, s = 576, 512
    k = 8
    cal = {"outlier_channels": list(range(k))}
    cs = C.available_codecs(cal)
    per = {n: c.payload_bytes(s, h) / (s * h) for n, c in cs.items()}
    assert per["fp16"] == per["bf16"] == 2.0
    assert per["int8-b64"] == pytest.approx(1 + 2 / 64)
    assert per["int4-b32"] == pytest.approx(0.5 + 2 / 32)
    assert per["int8-outlier"] < 1.03 and per["int4-outlier"] < 0.6


def test_zstd_only_when_smaller():
    c = C.get_codec("fp16")
    x = np.zeros((64, 64), np.float32)
    t = c.encode(x, zstd=True)
    assert t.zstd and len(t.data) < 64 * 64 * 2
    noise = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    assert not c.encode(noise, zstd=True).zstd  # 32 bytes never shrink under a zstd header


def test_fp16_refuses_values_beyond_its_range_and_bf16_takes_them():
    x = np.full((1, 4), 1e5, np.float32)
    with pytest.raises(P.ProtocolError) as e:
        C.get_codec("fp16").encode(x)
    assert e.value.code == "bad_tensor"
    assert np.allclose(C.get_codec("bf16").decode(C.get_codec("bf16").encode(x)), x, rtol=1e-2)


def test_bf16_rounds_to_nearest_even():
    x = np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9]], np.float32)
    y = C.get_codec("bf16").decode(C.get_codec("bf16").encode(x))
    assert list(y[0]) == [1.0, 1.0 + 4 * 2**-8, 1.0]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_encode_refuses_nan_inf(name, bad):
    x = hidden()
    x[2, 5] = bad
    with pytest.raises(P.ProtocolError) as e:
        codec(name).encode(x)
    assert e.value.code == "bad_tensor"


@pytest.mark.parametrize("name", NAMES)
def test_decode_refuses_wrong_size_and_wrong_codec(name):
    c = codec(name)
    t = c.encode(hidden(3))
    for data in (t.data[:-1], t.data + b"\x00"):
        with pytest.raises(P.ProtocolError) as e:
            c.decode(P.EncodedTensor(codec=name, shape=t.shape, data=data))
        assert e.value.code == "bad_tensor"
    with pytest.raises(P.ProtocolError) as e:
        c.decode(P.EncodedTensor(codec="other", shape=t.shape, data=t.data))
    assert e.value.code == "bad_codec"


def _scale_offsets(name, s, h):
    """Byte offset of the first float16 scale (or ref) in a payload with no sink rows."""
    if name.startswith(("int8-b", "int4-b")):
        return 0
    k = len(CALIB["outlier_channels"])
    return (s + 7) // 8 + 2 * s * k


@pytest.mark.parametrize("name", ["int8-b32", "int8-b64", "int4-b32", "int8-outlier", "int4-outlier"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_decode_refuses_nan_inf_negative_scales(name, bad):
    c = codec(name)
    x = hidden(4, massive=False)
    t = c.encode(x)
    data = bytearray(t.data)
    off = _scale_offsets(name, *x.shape)
    if name == "int4-outlier":  # the row reference is float32
        data[off:off + 4] = np.float32(bad).tobytes()
    else:
        data[off:off + 2] = np.float16(bad).tobytes()
    with pytest.raises(P.ProtocolError) as e:
        c.decode(P.EncodedTensor(codec=name, shape=t.shape, data=bytes(data)))
    assert e.value.code == "bad_tensor"


@pytest.mark.parametrize("name", ["int8-outlier", "int4-outlier"])
def test_decode_refuses_nan_in_outlier_and_sink_fields(name):
    c = codec(name)
    x = hidden(5)  # row 0 is a sink
    t = c.encode(x)
    nb = (x.shape[0] + 7) // 8
    for off in (nb, nb + 2 * x.shape[1]):  # first sink value, first outlier value
        data = bytearray(t.data)
        data[off:off + 2] = np.float16(np.nan).tobytes()
        with pytest.raises(P.ProtocolError) as e:
            c.decode(P.EncodedTensor(codec=name, shape=t.shape, data=bytes(data)))
        assert e.value.code == "bad_tensor"


def test_int4_outlier_refuses_a_row_ref_its_values_would_overflow_from():
    """A finite float32 ref near float32's max decoded to Inf (z up to 0.94 ref, un-rotated up to 3.75 ref): the
    decoder refuses refs over 2^126, and the encoder refuses rows that would need one instead of sending them."""
    c = codec("int4-outlier")
    x = hidden(4, s=1, massive=False)
    data = bytearray(c.encode(x).data)
    off = _scale_offsets("int4-outlier", 1, 64)
    n = 64 - len(CALIB["outlier_channels"])
    nb = -(-n // 16)
    data[off:off + 4] = np.float32(3.0e38).tobytes()
    data[off + 4:off + 4 + nb] = bytes(nb)  # every block at the row's scale
    data[off + 4 + nb:] = b"\xff" * (len(data) - off - 4 - nb)  # every code 15: one block un-rotates to 3.75 ref
    with pytest.raises(P.ProtocolError) as e:
        c.decode(P.EncodedTensor(codec="int4-outlier", shape=(1, 64), data=bytes(data)))
    assert e.value.code == "bad_tensor" and "2^126" in e.value.message
    no_sinks = C.get_codec("int4-outlier", outlier_channels=CALIB["outlier_channels"])
    big = np.zeros((1, 64), np.float32)
    rest = [i for i in range(64) if i not in CALIB["outlier_channels"]]
    big[0, rest[:16]] = 3e37 * rotation_signs()  # finite; the first rotated block's first value is 1.2e38
    with pytest.raises(P.ProtocolError) as e:
        no_sinks.encode(big)
    assert e.value.code == "bad_tensor" and "2^126" in e.value.message
    assert np.isfinite(no_sinks.decode(no_sinks.encode(big / 1e14))).all()  # 1e24 still codes


@pytest.mark.parametrize("name", NAMES)
def test_a_shape_decoding_past_the_limit_is_refused_before_decoding(name):
    """Every codec refuses a tensor whose float32 states exceed ``max_decoded_tensor_bytes`` (a 1.4 MB zstd frame of
    int4-b32 [2048, 30000] cost a server 0.8 GB and 5 s before its width was found wrong), and decode_rows agrees."""
    c = codec(name)
    x = hidden(7, s=8, massive=False)
    t = c.encode(x, zstd=True)
    exact = P.Limits(max_decoded_tensor_bytes=4 * x.size)
    assert c.decode(t, exact).shape == x.shape
    under = P.Limits(max_decoded_tensor_bytes=4 * x.size - 1)
    with pytest.raises(P.ProtocolError) as e:
        c.decode(t, under)
    assert e.value.code == "bad_tensor" and "decodes to more than" in e.value.message
    rows = [c.encode(x[i:i + 1]) for i in range(3)]
    assert c.decode_rows(rows, P.Limits(max_decoded_tensor_bytes=4 * 64)).shape == (3, 64)
    with pytest.raises(P.ProtocolError) as e:
        c.decode_rows(rows, P.Limits(max_decoded_tensor_bytes=4 * 64 - 1))
    assert e.value.code == "bad_tensor"


def test_decode_refuses_unused_codes_and_padding():
    c8 = C.get_codec("int8-b32")
    t = c8.encode(np.ones((1, 32), np.float32))
    data = bytearray(t.data)
    data[2] = 0x80  # code -128
    with pytest.raises(P.ProtocolError):
        c8.decode(P.EncodedTensor(codec="int8-b32", shape=(1, 32), data=bytes(data)))
    c4 = C.get_codec("int4-b32")
    t = c4.encode(np.ones((1, 3), np.float32))  # odd width: one padding nibble
    data = bytearray(t.data)
    data[-1] |= 0x10
    with pytest.raises(P.ProtocolError):
        c4.decode(P.EncodedTensor(codec="int4-b32", shape=(1, 3), data=bytes(data)))
    co = codec("int8-outlier")
    t = co.encode(hidden(6, s=3, massive=False))
    data = bytearray(t.data)
    data[0] |= 0x80  # bitmap padding bit for row 7 of a 3-row tensor
    with pytest.raises(P.ProtocolError):
        co.decode(P.EncodedTensor(codec="int8-outlier", shape=(3, 64), data=bytes(data)))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600), s=st.integers(0, 4), h=st.integers(41, 80), z=st.booleans())
def test_random_payloads_decode_or_refuse(name, data, s, h, z):
    c = codec(name)
    if z:
        data = b"\x28\xb5\x2f\xfd" + data
    try:
        y = c.decode(P.EncodedTensor(codec=name, shape=(s, h), data=data, zstd=z))
    except P.ProtocolError as e:
        assert e.code in P.PROTOCOL_ERROR_CODES
    else:
        assert y.shape == (s, h) and np.isfinite(y).all()


def test_fuzzed_payloads_decode_or_refuse():
    """tests/shared/codec_fuzz.py over the calibration-free and outlier codecs: every damaged payload decodes to
    finite float32 of its shape or is refused with a documented code, within 1 s and bounded memory (the PCA
    codecs and the 100,000-iteration run: tests/shared/test_codecs_pca.py)."""
    report = codec_fuzz.fuzz(C.available_codecs(CALIB), 480, seed=1)
    assert report["n_failures"] == 0, report["failures"]
    by = report["by_strategy"]
    assert all(by[k].get("refused") for k in ("truncation", "extension", "shape", "nonfinite", "zstd_bomb", "rows"))
    assert all(by[k].get("accepted") for k in ("bit_flips", "byte_runs", "zstd_wrap")), by  # damage that stays valid


def test_the_codec_fuzzer_reports_what_it_is_looking_for(monkeypatch):
    """The harness can fail: another exception type, a non-finite output and a slow decode are each reported."""
    codecs = {name: codec(name) for name in ("int8-b32", "fp16", "bf16")}
    monkeypatch.setattr(codecs["int8-b32"], "decode_payload", lambda *a: {}[1])  # KeyError (not a ProtocolError)
    monkeypatch.setattr(codecs["fp16"], "decode", lambda t, limits=None: np.full(t.shape, np.inf, np.float32))
    monkeypatch.setattr(codec_fuzz, "MAX_DECODE_S", 0.0)
    errors = " ".join(f["error"] for f in codec_fuzz.fuzz(codecs, 60, seed=2, keep=60)["failures"])
    assert "KeyError" not in errors  # decode() turns a layout bug into bad_tensor, as documented ...
    monkeypatch.setattr(codecs["int8-b32"], "decode", lambda t, limits=None: {}[1])
    errors = " ".join(f["error"] for f in codec_fuzz.fuzz(codecs, 60, seed=2, keep=60)["failures"])
    assert "KeyError" in errors and "NaN or Inf" in errors and "took" in errors  # ... but not a decode() bug


def test_outlier_codec_parameters_are_checked():
    for bad in ([], [-1], [1, 1], ["x"], [1.5], [True], list(range(300)), None, 3):
        with pytest.raises(P.ProtocolError) as e:
            C.get_codec("int8-outlier", outlier_channels=bad)
        assert e.value.code == "bad_codec"
    with pytest.raises(P.ProtocolError):
        C.get_codec("int8-outlier")  # the bundle's calibration is required
    for thr in (float("nan"), -1.0, 0.0, "x", [1]):
        with pytest.raises(P.ProtocolError):
            C.get_codec("int8-outlier", outlier_channels=[1], sink_threshold=thr)
    assert C.get_codec("int8-outlier", outlier_channels=np.array([3, 1]), sink_threshold=np.float32(2)).outlier_channels == [1, 3]
    with pytest.raises(P.ProtocolError):
        C.get_codec("nope")
    with pytest.raises(P.ProtocolError):
        C.get_codec("fp16", block=3)
    c = C.get_codec("int8-outlier", outlier_channels=[100])
    with pytest.raises(P.ProtocolError) as e:  # a codec for another model's width
        c.decode(P.EncodedTensor(codec="int8-outlier", shape=(1, 64), data=b""))
    assert e.value.code == "bad_codec"


def test_available_codecs_without_calibration():
    assert set(C.available_codecs()) == set(C.CODEC_NAMES) - set(C.CALIBRATED_CODECS)
    assert set(C.available_codecs(CALIB)) == set(NAMES)


def test_hadamard_is_orthonormal_and_symmetric():
    for n in (1, 2, 16, 64):
        m = hadamard(n)
        assert np.allclose(m @ m, np.eye(n), atol=1e-6) and np.allclose(m, m.T)
    with pytest.raises(ValueError):
        hadamard(12)


def test_find_outlier_channels_and_sink_threshold():
    x = hidden(7, s=200)
    x[:, 40] *= 50
    ch = C.find_outlier_channels(x, k=2)
    assert ch == [17, 40]  # the sink row (row 0) does not decide
    thr = C.find_sink_threshold(x, ch)
    rest = np.abs(np.delete(x, ch, axis=1)).max(axis=1)
    assert rest[0] > thr > rest[1:].max()
    with pytest.raises(ValueError):
        C.find_outlier_channels(x, k=0)
    with pytest.raises(ValueError):
        C.find_outlier_channels(np.full((2, 3), np.nan), k=1)
