"""partition_tools.gptq: onnxruntime's own grid, lower output error than round-to-nearest, codes the kernel reads."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from partition_tools.gptq import dequantize, gptq_round, write_codes

K, N, T = 64, 6, 256


def _quantized_matmul(w: np.ndarray) -> onnx.ModelProto:
    """One MatMul x [T, K] @ w, rewritten by onnxruntime's quantizer (int8, symmetric, block 32, level 1)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    q = MatMulNBitsQuantizer(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), bits=8,
                             block_size=32, is_symmetric=True, accuracy_level=1)
    q.process()
    return q.model.model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[5, 0], w[40, 1] = 4.0, -5.0  # blocks whose largest value is positive / negative
    mix = rng.standard_normal((K, K)) * 0.3 + np.eye(K)  # correlated channels, as real activations are
    x = (rng.standard_normal((T, K)) @ mix).astype(np.float32)
    x[:, 3] *= 8.0  # an outlier channel
    return w, x


def test_without_calibration_it_is_onnxruntimes_rounding(data):
    w, _ = data
    model = _quantized_matmul(w)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    q, scales = gptq_round(w, np.zeros((K, K)), damp=1e-6)  # no inputs seen: every row rounded to nearest
    assert np.array_equal(inits[node.input[1]], (q.astype(np.int16) + 128).astype(np.uint8).T.reshape(N, 2, 32))
    np.testing.assert_array_equal(inits[node.input[2]].reshape(N, 2), scales.T)
    assert q.min() >= -128 and q.max() <= 127 and (q == -128).any()  # the max-magnitude value sits at -128


def test_gptq_codes_lower_the_output_error_and_are_what_the_kernel_reads(data):
    w, x = data
    model = _quantized_matmul(w)
    nearest = _run(model, x)
    q, scales = gptq_round(w, x.astype(np.float64).T @ x)
    write_codes(model, next(n for n in model.graph.node if n.op_type == "MatMulNBits"), q, scales, 8)
    got = _run(model, x)
    np.testing.assert_allclose(got, x @ dequantize(q, scales), rtol=1e-5, atol=1e-4)
    ref = x @ w
    assert np.mean((got - ref) ** 2) < 0.8 * np.mean((nearest - ref) ** 2)


def test_bad_shapes_and_modes_are_refused(data):
    w, x = data
    with pytest.raises(ValueError, match="gram must be"):
        gptq_round(w, np.eye(40))
    model = _quantized_matmul(w)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    q, scales = gptq_round(w, x.astype(np.float64).T @ x)
    with pytest.raises(ValueError, match="8-bit"):
        write_codes(model, node, q, scales, 4)
    with pytest.raises(ValueError, match="do not match"):
        write_codes(model, node, q[:32], scales[:1], 8)
