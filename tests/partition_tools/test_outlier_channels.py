"""partition_tools.smoothing.split_outlier_channels + quantize_front(outlier_channels=k): the static LLM.int8()
decomposition (the k largest calibration input channels of a MatMul in fp32 beside the int8 MatMul)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from partition_tools.adapters import ModelAdapter
from partition_tools.graph_builder import build_fused_front
from partition_tools.models import load_model
from partition_tools.quantize import QuantizationError, quantize_front, weight_matmuls
from partition_tools.outlier_channels import split_outlier_channels
from partition_tools.smoothing import calibration_feeds, matmul_input_absmax

N = 2


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """The fused fp32 front (packed q|k|v and gate|up) of the tiny random GLM-4, N layers."""
    lm = load_model("tiny-glm4")
    adapter = ModelAdapter(lm.model)
    return adapter, build_fused_front(adapter, N, tmp_path_factory.mktemp("oc") / "front.onnx")


def _ids(adapter, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, adapter.vocab_size, n)


def _run(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(["hidden_states"], calibration_feeds(model, ids))[0]


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize("fold", [True, False])
def test_split_keeps_the_fp32_function_and_zeroes_the_main_rows(fused, fold):
    adapter, path = fused
    model = onnx.load(str(path))
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    names = list(weight_matmuls(model))
    nodes = {n.name: n for n in model.graph.node}
    cal = _ids(adapter, 64, 5)
    inputs = {n: nodes[n].input[0] for n in names}
    absmax = matmul_input_absmax(model, cal, list(inputs.values()))
    done = split_outlier_channels(model, cal, names, 3, fold=fold)
    assert sorted(done) == sorted(names)
    expected = {"qkv_proj": "norm", "gate_up_proj": "norm", "down_proj": "cols", "o_proj": "mask"}
    inits = _inits(model)
    for name, info in done.items():
        a = absmax[inputs[name]]
        assert len(set(info["channels"])) == 3 and a[info["channels"]].min() >= np.sort(a)[-3]  # the 3 largest
        assert info["masked_by"] == (expected[name.rsplit(".", 1)[1]] if fold else "mask")
        main = next(n for n in model.graph.node if n.name == name)
        w = inits[main.input[1]]
        assert not w[info["channels"]].any() and w.any()  # the main MatMul no longer carries those rows
        assert inits[f"{name}.outlier.weight"].shape == (3, w.shape[1])
    ids = _ids(adapter, 20, 9)
    a, b = _run(ref, ids), _run(model, ids)
    assert np.abs(a - b).max() < 1e-5 * np.abs(a).max() + 1e-6


def test_min_ratio_leaves_mild_inputs_alone(fused):
    adapter, path = fused
    model = onnx.load(str(path))
    names = list(weight_matmuls(model))
    nodes = {n.name: n for n in model.graph.node}
    cal = _ids(adapter, 64, 5)
    absmax = matmul_input_absmax(model, cal, [nodes[n].input[0] for n in names])
    ratio = {n: absmax[nodes[n].input[0]].max() / np.median(absmax[nodes[n].input[0]]) for n in names}
    cut = float(np.median(list(ratio.values())))
    done = split_outlier_channels(model, cal, names, 2, min_ratio=cut)
    assert sorted(done) == sorted(n for n in names if ratio[n] >= cut) and 0 < len(done) < len(names)


def _with_outliers(path, dst, factor: float = 40.0) -> None:
    """The same fp32 function with an outlier channel in every norm-fed MatMul input: the norm weight's
    channel 5 times ``factor``, the MatMul rows 5 divided by it."""
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    for layer in range(N):
        for norm, mm in (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj")):
            g = numpy_helper.to_array(inits[f"layers.{layer}.{norm}.weight"]).copy()
            w = numpy_helper.to_array(inits[nodes[f"layers.{layer}.{mm}"].input[1]]).copy()
            g[5] *= factor
            w[5] /= factor
            inits[f"layers.{layer}.{norm}.weight"].CopyFrom(numpy_helper.from_array(g, f"layers.{layer}.{norm}.weight"))
            name = nodes[f"layers.{layer}.{mm}"].input[1]
            inits[name].CopyFrom(numpy_helper.from_array(w, name))
    onnx.save(model, str(dst))


def test_int8_with_outlier_channels_recovers_the_error_an_outlier_costs(fused, tmp_path):
    adapter, path = fused
    src = tmp_path / "outliers.onnx"
    _with_outliers(path, src)
    ids, cal = _ids(adapter, 24, 3), _ids(adapter, 64, 5)
    ref = _run(onnx.load(str(path)), ids)
    assert np.abs(_run(onnx.load(str(src)), ids) - ref).max() < 1e-4 * np.abs(ref).max()  # same fp32 function
    err = {}
    for k in (0, 1):
        dst = tmp_path / f"q{k}.onnx"
        report = quantize_front(src, dst, "int8", outlier_channels=k, calibration_ids=cal)
        err[k] = float(np.abs(_run(onnx.load(str(dst)), ids) - ref).mean())
        if k:
            assert len(report["outlier_channels"]["matmuls"]) == 4 * N
            q = onnx.load(str(dst))
            sides = [n for n in q.graph.node if n.op_type == "MatMul" and n.name.endswith(".outlier.matmul")]
            assert len(sides) == 4 * N and sum(n.op_type == "MatMulNBits" for n in q.graph.node) == 4 * N
    assert err[1] < 0.5 * err[0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"outlier_channels": 4}, "calibration_ids"),
    ({"outlier_channels": -1, "calibration_ids": np.arange(8)}, "outlier_channels -1"),
    ({"outlier_channels": 4, "rotate": ["*"], "calibration_ids": np.arange(8)}, "pick one"),
])
def test_outlier_channel_arguments_are_checked(fused, kwargs, match, tmp_path):
    with pytest.raises(QuantizationError, match=match):
        quantize_front(fused[1], tmp_path / "q.onnx", "int8", **kwargs)
