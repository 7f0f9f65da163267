"""SplitTranslator._decode_steps: a loop turn's decode steps decoded per codec in one pass (fp16 widened by
torch), each row exactly what the codec's own decode gives, and a bad step failing alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_server.split_translate import BadInput, SplitTranslator, widen_half
from shared import protocol as P
from shared.codecs import available_codecs

CALIB = {"outlier_channels": [3, 17, 40], "sink_threshold": 30.0}
H = 64


def _translator() -> SplitTranslator:
    return SplitTranslator(None, available_codecs(CALIB), P.Limits(), lambda: 0.0)


def _step(codec, seed: int, rid: str = "r") -> tuple:
    x = np.random.default_rng(seed).standard_normal((1, H)).astype(np.float32)
    return (None, None, P.DecodeStep(request_id=rid, position=5, hidden=codec.encode(x)), 0)


def _as_array(row) -> np.ndarray:
    return row.numpy() if isinstance(row, torch.Tensor) else row


@pytest.mark.parametrize("name", ["fp16", "int8-outlier", "bf16", "int8-b32"])
def test_rows_equal_the_codecs_decode_and_a_bad_step_fails_alone(name):
    tr = _translator()
    codec = tr.codecs[name]
    steps = [_step(codec, i) for i in range(6)]
    rows = tr._decode_steps(steps)
    for (_, _, msg, _), row in zip(steps, rows, strict=True):
        assert row.shape == (1, H) and row.dtype in (np.float32, torch.float32)
        assert np.array_equal(_as_array(row), codec.decode(msg.hidden))
    bad = steps[2][2].hidden
    steps[2] = (None, None, P.DecodeStep(request_id="bad", position=5,
                                         hidden=P.EncodedTensor(codec=name, shape=(1, H), data=bad.data[:-2])), 0)
    rows = tr._decode_steps(steps)
    assert isinstance(rows[2], BadInput) and rows[2].code == "bad_tensor"
    for i in (0, 1, 3, 4, 5):
        assert np.array_equal(_as_array(rows[i]), codec.decode(steps[i][2].hidden))


def test_a_nan_fp16_step_fails_alone_and_codecs_mix_in_one_turn():
    tr = _translator()
    fp16, int8 = tr.codecs["fp16"], tr.codecs["int8-outlier"]
    steps = [_step(fp16, 0), _step(int8, 1), _step(fp16, 2), _step(int8, 3)]
    data = bytearray(steps[2][2].hidden.data)
    data[10:12] = (0x7E00).to_bytes(2, "little")  # a NaN
    steps[2] = (None, None, P.DecodeStep(request_id="r", position=5,
                                         hidden=P.EncodedTensor(codec="fp16", shape=(1, H), data=bytes(data))), 0)
    rows = tr._decode_steps(steps)
    assert isinstance(rows[2], BadInput) and "NaN" in rows[2].message
    for i, codec in ((0, fp16), (1, int8), (3, int8)):
        assert np.array_equal(_as_array(rows[i]), codec.decode(steps[i][2].hidden))
    unknown = (None, None, P.DecodeStep(request_id="u", position=5, hidden=P.EncodedTensor(
        codec="nope", shape=(1, H), data=b"\0" * (2 * H))), 0)
    assert tr._decode_steps([unknown]) == [None]  # refused on the loop by name


def test_widen_half_is_exact_in_blocks():
    half = np.random.default_rng(0).standard_normal((37, 4096)).astype(np.float16)  # blocks of 7 rows + a tail
    half[0, :4] = [6.1e-8, -6.1e-8, 65504, -65504]  # a subnormal, the range's ends
    out = widen_half(half)
    assert out.dtype == torch.float32 and np.array_equal(out.numpy(), half.astype(np.float32))
