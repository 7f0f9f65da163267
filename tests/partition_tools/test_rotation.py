"""partition_tools.rotation: block-Hadamard rotation folded into the weights keeps the fp32 function."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edge_client.front import FrontRuntime
from partition_tools.quantize import quantize_front
from partition_tools.rotation import hadamard, rotate_matmul_inputs


def test_hadamard_is_orthonormal():
    h = hadamard(32)
    np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-6)
    with pytest.raises(ValueError):
        hadamard(24)


def test_rotation_keeps_the_function(tiny_glm4_fp32_bundle, tmp_path):
    src = tiny_glm4_fp32_bundle / "edge" / "front.onnx"
    model = onnx.load(str(src))
    done = rotate_matmul_inputs(model, ["layers.*"], block=16)
    assert len(done) == 8  # qkv, o, gate_up, down in each of the 2 layers
    onnx.save(model, str(tmp_path / "rot.onnx"))
    ids = np.random.default_rng(0).integers(4, 512, 20)
    ref = FrontRuntime(tiny_glm4_fp32_bundle, threads=1).prefill(ids)
    got = FrontRuntime(tiny_glm4_fp32_bundle, threads=1, graph=tmp_path / "rot.onnx").prefill(ids)
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_rotated_int8_keeps_the_hadamard_in_fp32(tiny_glm4_fp32_bundle, tmp_path):
    src = tiny_glm4_fp32_bundle / "edge" / "front.onnx"
    report = quantize_front(src, tmp_path / "q.onnx", "int8", rotate=["layers.*.mlp.down_proj"])
    assert report["rotated_matmuls"] == ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]
    nodes = onnx.load(str(tmp_path / "q.onnx")).graph.node
    assert sum(n.op_type == "MatMulNBits" for n in nodes) == 8
    assert sum(n.op_type == "MatMul" and n.name.endswith(".rot.hadamard") for n in nodes) == 2
