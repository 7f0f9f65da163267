"""partition_tools.source_grid + quantize_front(source_grid=...): a Q4-grid checkpoint's weights kept on their own
grid in the 8-bit MatMulNBits codes instead of rounded again."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partition_tools.adapters import ModelAdapter
from partition_tools.graph_builder import build_fused_front
from partition_tools.models import load_model
from partition_tools.quantize import QuantizationError, quantize_front, weight_matmuls
from partition_tools.smoothing import calibration_feeds
from partition_tools.source_grid import fit_grid, grid_codes, write_codes

N = 2


def _q4_1(w: np.ndarray, block: int = 32) -> np.ndarray:
    """``w [K, N]`` snapped onto a Q4_1 grid (per block of ``block`` rows and column: min + d * j, j in 0..15),
    as llama.cpp's quantizer leaves a checkpoint (d and the minimum in fp16)."""
    k, n = w.shape
    wb = w.reshape(k // block, block, n)
    lo = wb.min(1).astype(np.float16).astype(np.float32)
    d = ((wb.max(1) - lo) / 15).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((wb - lo[:, None]) / np.where(d > 0, d, 1)[:, None]), 0, 15)
    return (lo[:, None] + q * d[:, None]).reshape(k, n).astype(np.float32)


def _run(model: onnx.ModelProto, feeds: dict, out: str = "hidden_states") -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run([out], feeds)[0]


def test_fit_recognises_the_grid_and_nothing_else():
    rng = np.random.default_rng(0)
    w = _q4_1(rng.standard_normal((96, 24)).astype(np.float32))
    lo, d, q = fit_grid(w)
    assert lo.shape == d.shape == (3, 24) and q.min() >= 0 and q.max() <= 15
    np.testing.assert_allclose(np.repeat(lo, 32, 0) + np.repeat(d, 32, 0) * q, w, atol=1e-6)
    assert fit_grid(w + 1e-3 * rng.standard_normal(w.shape).astype(np.float32)) is None  # off the grid
    assert fit_grid(rng.standard_normal((96, 24)).astype(np.float32)) is None  # a bf16-like checkpoint
    assert fit_grid(w[:80]) is None  # K not a whole number of blocks


def test_codes_hold_the_levels_and_the_residual_is_the_offset_left():
    rng = np.random.default_rng(1)
    w = _q4_1(rng.standard_normal((64, 40)).astype(np.float32) * 0.05)
    w[:32, 0] = 0.25  # a constant block
    codes, scales, zp, resid = grid_codes(*fit_grid(w))
    deq = np.repeat(scales, 32, 0) * (codes.astype(np.float32) - np.repeat(zp, 32, 0))  # [K, N]
    np.testing.assert_allclose(deq + np.repeat(resid, 32, 0), w, atol=1e-6)
    assert np.abs(resid).max() < 0.5 * np.abs(w).max() / 127  # below round-to-nearest int8's worst error
    assert np.sqrt((resid ** 2).mean()) < 0.2 * np.abs(w).max() / 127
    assert resid[0, 0] == 0 and codes.dtype == zp.dtype == np.uint8


def _matmul_nbits(w: np.ndarray) -> onnx.ModelProto:
    """y = x @ w as one 8-bit MatMulNBits node with placeholder codes (written by write_codes)."""
    k, n = w.shape
    nb = k // 32
    inits = [numpy_helper.from_array(np.zeros((n, nb, 32), np.uint8), "B"),
             numpy_helper.from_array(np.ones(n * nb, np.float32), "S")]
    node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], name="mm", domain="com.microsoft", K=k, N=n,
                            bits=8, block_size=32, accuracy_level=1)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_written_codes_run_in_onnxruntime_as_the_grid_weights():
    rng = np.random.default_rng(2)
    w = _q4_1(rng.standard_normal((64, 48)).astype(np.float32) * 0.05)
    model = _matmul_nbits(w)
    codes, scales, zp, resid = grid_codes(*fit_grid(w))
    write_codes(model, model.graph.node[0], codes, scales, zp)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    y = _run(model, {"x": x}, "y")
    np.testing.assert_allclose(y, x @ (w - np.repeat(resid, 32, 0)), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def grid_front(tmp_path_factory):
    """The fused fp32 front of the tiny random GLM-4 (N layers) with every MatMul weight on a Q4_1 grid."""
    lm = load_model("tiny-glm4")
    adapter = ModelAdapter(lm.model)
    tmp = tmp_path_factory.mktemp("grid")
    path = build_fused_front(adapter, N, tmp / "front.onnx")
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for name in weight_matmuls(model):
        init = inits[nodes[name].input[1]]
        init.CopyFrom(numpy_helper.from_array(_q4_1(numpy_helper.to_array(init)), init.name))
    onnx.save(model, str(tmp / "grid.onnx"))
    return adapter, tmp / "grid.onnx"


@pytest.mark.parametrize(("mode", "block"), [("int8", 32), ("int8", 16), ("int4", 32)])
def test_exact_grid_front_at_fp32_activations_is_the_fp32_front(grid_front, tmp_path, mode, block):
    adapter, src = grid_front
    ids = np.random.default_rng(3).integers(4, adapter.vocab_size, 12)
    ref_model = onnx.load(str(src))
    ref = _run(ref_model, calibration_feeds(ref_model, ids))
    errs = {}
    for grid in ("exact", None):
        dst = tmp_path / f"{grid}.onnx"
        report = quantize_front(src, dst, mode, block_size=block, accuracy_level=1, source_grid=grid)
        q = onnx.load(str(dst))
        errs[grid] = float(np.abs(_run(q, calibration_feeds(q, ids)) - ref).max())
        if grid:
            assert len(report["source_grid"]["matmuls"]) == 4 * N
    assert errs["exact"] < 1e-4 * np.abs(ref).max()
    assert errs["exact"] < 0.05 * errs[None]  # round-to-nearest of the same weights


def test_off_grid_weights_fall_back_to_rounding(tmp_path):
    lm = load_model("tiny-glm4")
    src = build_fused_front(ModelAdapter(lm.model), 1, tmp_path / "front.onnx")
    report = quantize_front(src, tmp_path / "q.onnx", "int8", source_grid="offset")
    assert report["source_grid"]["matmuls"] == [] and report["quantized_matmuls"] == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"source_grid": "yes"}, "source grid 'yes'"),
    ({"source_grid": "offset", "gptq": True, "calibration_ids": np.arange(8)}, "rounded to nearest"),
    ({"source_grid": "offset", "mode": "int4"}, "use .exact."),
])
def test_source_grid_arguments_are_checked(grid_front, tmp_path, kwargs, match):
    kwargs = dict(kwargs)
    with pytest.raises(QuantizationError, match=match):
        quantize_front(grid_front[1], tmp_path / "q.onnx", kwargs.pop("mode", "int8"), **kwargs)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_outlier_channels_keep_the_main_rows_on_their_grid(grid_front, tmp_path, mode):
    """With the source grid, the split channels' main rows stay (zeroing them would take their blocks off the
    grid): the side path carries the rest, the fp32 function is kept and every MatMul is still on its grid."""
    adapter, src = grid_front
    ids = np.random.default_rng(4).integers(4, adapter.vocab_size, 12)
    cal = np.random.default_rng(5).integers(4, adapter.vocab_size, 64)
    ref_model = onnx.load(str(src))
    ref = _run(ref_model, calibration_feeds(ref_model, ids))
    dst = tmp_path / "q.onnx"
    report = quantize_front(src, dst, mode, accuracy_level=1, source_grid="exact", outlier_channels=3,
                            calibration_ids=cal)
    assert len(report["source_grid"]["matmuls"]) == 4 * N and len(report["outlier_channels"]["matmuls"]) == 4 * N
    from partition_tools.inspect_bundle import recipe_summary

    assert (f"fp32 activations, source grid kept on {4 * N} of {4 * N} MatMuls, offsets exact in fp32, 3 fp32 "
            "outlier channels") in recipe_summary(report)
    q = onnx.load(str(dst))
    assert np.abs(_run(q, calibration_feeds(q, ids)) - ref).max() < 1e-4 * np.abs(ref).max()
    sides = [n for n in q.graph.node if n.name.endswith(".outlier.gather")]
    assert len(sides) == 4 * N and {n.op_type for n in sides} == {"MatMul"}  # one selecting MatMul for both


def test_the_recipe_keeps_the_grid_of_a_grid_source_only():
    import torch

    from partition_tools.quantize import on_source_grid, recipe_for, resolve_edge_quant

    lm = load_model("tiny-glm4")
    adapter = ModelAdapter(lm.model)
    plain = recipe_for(adapter, N)
    assert not on_source_grid(adapter, N) and plain["smooth_alpha"] == 0.5 and "source_grid" not in plain
    with torch.no_grad():
        for layer in list(adapter.layers)[:N]:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):  # weight [out, in]: the grid runs along the input
                    m.weight.copy_(torch.from_numpy(_q4_1(m.weight.float().numpy().T).T.copy()))
    assert on_source_grid(adapter, N) and not on_source_grid(adapter, N + 1)
    grid = recipe_for(adapter, N)
    assert grid["source_grid"] == "offset" and grid["smooth_alpha"] is None and grid["outlier_channels"] == 16
    assert resolve_edge_quant("auto", adapter, N) == "int4" and resolve_edge_quant("auto", adapter, N + 1) == "int8"
    assert resolve_edge_quant("int8", adapter, N) == "int8"
    with pytest.raises(QuantizationError, match="expected one of auto"):
        resolve_edge_quant("int3", adapter, N)
    four = recipe_for(adapter, N, "int4")
    assert four["source_grid"] == "exact"  # 4-bit zero points need the offsets back
    assert four["accuracy_level"] == 1 and "outlier_channels" not in four  # fp32 activations: nothing to split off
