"""SplitTranslator._decode_steps: a loop turn's decode steps decoded per codec in one pass (fp16 rows left as
float16 for the engine to widen), each row exactly what the codec's own decode gives, and a bad step failing alone;
the hand-over's runs of plain steps as one array (float16 where every row is)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cloud_server.split_translate import BadInput, SplitTranslator
from shared import protocol as P
from shared.codecs import available_codecs

CALIB = {"outlier_channels": [3, 17, 40], "sink_threshold": 30.0}
H = 64


def _translator() -> SplitTranslator:
    runtime = SimpleNamespace(facts=SimpleNamespace(hidden_size=H, mrope=False))
    return SplitTranslator(runtime, available_codecs(CALIB), P.Limits(), lambda: 0.0)


def _step(codec, seed: int, rid: str = "r") -> tuple:
    x = np.random.default_rng(seed).standard_normal((1, H)).astype(np.float32)
    return (None, None, P.DecodeStep(request_id=rid, position=5, hidden=codec.encode(x)), 0)


def _as_array(row) -> np.ndarray:
    """A decoded row as float32 (fp16's rows come as float16: widening is exact)."""
    return (row.numpy() if isinstance(row, torch.Tensor) else row).astype(np.float32)


@pytest.mark.parametrize("name", ["fp16", "int8-outlier", "bf16", "int8-b32"])
def test_rows_equal_the_codecs_decode_and_a_bad_step_fails_alone(name):
    tr = _translator()
    codec = tr.codecs[name]
    steps = [_step(codec, i) for i in range(6)]
    rows = tr._decode_steps(steps)
    for (_, _, msg, _), row in zip(steps, rows, strict=True):
        assert row.shape == (1, H) and row.dtype == (np.float16 if name == "fp16" else np.float32)
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


def test_a_step_of_another_width_fails_alone_without_being_decoded():
    """The width comes from the declared shape, before the payload is decoded: a step declaring 2^20 channels in a
    few bytes is bad_input (it was decoded first, and refused as bad_tensor); a step of the wrong width with a
    valid payload is refused the same way, and the others decode."""
    tr = _translator()
    fp16 = tr.codecs["fp16"]
    steps = [_step(fp16, i) for i in range(3)]
    wide = fp16.encode(np.zeros((1, 2 * H), np.float32))
    steps[0] = (None, None, P.DecodeStep(request_id="w", position=5, hidden=P.EncodedTensor(
        codec="fp16", shape=(1, 1 << 20), data=b"\0" * 6)), 0)
    steps[1] = (None, None, P.DecodeStep(request_id="v", position=5, hidden=wide), 0)
    rows = tr._decode_steps(steps)
    assert [(type(r).__name__, getattr(r, "code", None)) for r in rows[:2]] == [("BadInput", "bad_input")] * 2
    assert np.array_equal(_as_array(rows[2]), fp16.decode(steps[2][2].hidden))


class _Engine:
    def __init__(self):
        self.calls: list[tuple] = []

    def add_rows(self, ids, starts, hidden):
        self.calls.append(("rows", list(ids), list(starts), hidden.clone()))

    def add_inputs(self, batch):
        self.calls.append(("inputs", [rid for rid, _ in batch], [c.start for _, c in batch]))

    def abort(self, rid, reason="abort"):
        self.calls.append(("abort", rid, reason))


class _Metrics:
    def __init__(self):
        self.uplink: list[tuple] = []

    def on_uplink_steps(self, sizes, codec):
        self.uplink += [(n, codec) for n in sizes]

    def on_uplink(self, nbytes, codec, tokens):
        self.uplink.append((nbytes, codec))


class _Session:
    closed = False

    def __init__(self):
        self.sent, self.records = [], {}

    def record(self, rid):
        return self.records.get(rid)

    def send(self, msg):
        self.sent.append(msg)


def test_hand_over_sends_runs_of_plain_steps_as_one_array_in_order():
    """Plain steps go as one [S, H] array per run (add_rows), a step asking for drafts as a chunk between them,
    a bad step fails its request alone after the steps before it went; every step's bytes are counted."""
    tr = _translator()
    engine, metrics = _Engine(), _Metrics()
    tr.rt = SimpleNamespace(engine=engine, metrics=metrics,
                            facts=SimpleNamespace(hidden_size=H, mrope=False))
    codec = tr.codecs["int8-outlier"]
    session = _Session()
    steps = []
    for i in range(6):
        x = np.random.default_rng(i).standard_normal((1, H)).astype(np.float32)
        msg = P.DecodeStep(request_id=f"r{i}", position=10 + i, hidden=codec.encode(x), ask_drafts=2 if i == 2 else 0)
        rec = SimpleNamespace(active=True, engine_id=f"e{i}", last_input=0.0)
        session.records[f"r{i}"] = rec
        steps.append((session, SimpleNamespace(owner=rec, request_id=f"r{i}"), msg, 100 + i))
    wide = np.random.default_rng(9).standard_normal((1, H + 8)).astype(np.float32)  # another model's width
    steps.append((session, SimpleNamespace(owner=SimpleNamespace(active=True, engine_id="e6", last_input=0.0),
                                           request_id="r6"),
                  P.DecodeStep(request_id="r6", position=16, hidden=codec.encode(wide)), 106))
    session.records["r6"] = steps[-1][1].owner
    rows = tr._decode_steps(steps)
    rows[4] = BadInput("bad_tensor", "broken")
    tr._hand_over_steps(steps, rows)
    kinds = [(c[0], c[1]) for c in engine.calls]
    assert kinds == [("rows", ["e0", "e1"]), ("inputs", ["e2"]), ("rows", ["e3"]), ("abort", "e4"), ("rows", ["e5"]),
                     ("abort", "e6")]
    first = engine.calls[0]
    assert first[2] == [10, 11] and first[3].shape == (2, H) and first[3].dtype == torch.float32
    assert np.array_equal(first[3].numpy(), np.concatenate([codec.decode(steps[i][2].hidden) for i in (0, 1)]))
    assert [(m.code, m.request_id) for m in session.sent] == [("bad_tensor", "r4"), ("bad_input", "r6")]
    assert "width" in session.sent[1].message
    assert sorted(metrics.uplink) == [(100 + i, "int8-outlier") for i in (0, 1, 2, 3, 5)]
    assert all(steps[i][1].owner.last_input > 0 for i in (0, 1, 2, 3, 5))


def test_fp16_steps_go_to_the_engine_as_float16_and_a_mixed_run_as_float32():
    """A run of fp16 steps reaches add_rows as one float16 [S, H] array (half the bytes to pickle and upload); a run
    that mixes fp16 with another codec as float32, every row exactly its codec's decode."""
    tr = _translator()
    engine, metrics = _Engine(), _Metrics()
    tr.rt = SimpleNamespace(engine=engine, metrics=metrics, facts=SimpleNamespace(hidden_size=H, mrope=False))
    session = _Session()

    def steps_of(codecs):
        out = []
        for i, codec in enumerate(codecs):
            rec = SimpleNamespace(active=True, engine_id=f"e{i}", last_input=0.0)
            _, _, msg, _ = _step(codec, 20 + i, f"r{i}")
            out.append((session, SimpleNamespace(owner=rec, request_id=f"r{i}"), msg, 10))
        return out

    fp16, int8 = tr.codecs["fp16"], tr.codecs["int8-outlier"]
    for codecs, dtype in (([fp16] * 5, torch.float16), ([fp16, int8, fp16], torch.float32)):
        engine.calls.clear()
        steps = steps_of(codecs)
        tr._hand_over_steps(steps, tr._decode_steps(steps))
        [(kind, ids, starts, hidden)] = engine.calls
        assert kind == "rows" and ids == [f"e{i}" for i in range(len(codecs))] and hidden.dtype == dtype
        want = np.concatenate([c.decode(s[2].hidden) for c, s in zip(codecs, steps)])  # [S, H] float32
        assert np.array_equal(hidden.float().numpy(), want)
