"""partition_tools.export_whole: the whole model as one ONNX graph (the all-edge baseline) equals the torch
model, through prefill and KV-cached decode; the int8 export quantizes every projection, the lm_head too."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from model_support import hf_greedy

from partition_tools.export_whole import export_whole
from partition_tools.quantize import QuantizationError
from rig.all_edge import WholeModelRunner


@pytest.fixture(scope="module")
def whole_fp32(tiny_glm4_whole):
    """``export_whole(tiny_glm4_lm, out, "fp32")``: the session's one export (tests/conftest.py)."""
    return tiny_glm4_whole


def test_fp32_whole_graph_greedy_equals_torch(whole_fp32, tiny_glm4_lm):
    ids = [int(t) for t in np.random.RandomState(3).randint(4, 500, 40)]
    ref = hf_greedy(tiny_glm4_lm.model, ids, 12)
    runner = WholeModelRunner(whole_fp32, threads=1, chunk=16)  # 40 prompt tokens: three prefill chunks
    runner.eos = set()  # random weights: compare the full 12 tokens
    run = runner.generate(ids, 12)
    assert run.token_ids == ref and len(run.itl_s) == 11 and run.cached_tokens == 0
    again = runner.generate(ids + ref[:5], 4)  # the previous request's KV is reused for the common prefix
    assert again.cached_tokens == len(ids) + 5 - 1 and again.token_ids == ref[5:9]
    meta = json.loads((whole_fp32 / "whole.json").read_text())
    assert meta["num_layers"] == 4 and meta["quant"] == "fp32"


@pytest.mark.slow  # the rig's all-edge runs use the fp32 export in the default suite
def test_int8_whole_graph_quantizes_the_lm_head(tmp_path, tiny_glm4_lm):
    meta = export_whole(tiny_glm4_lm, tmp_path / "int8", "int8")
    model = onnx.load(str(tmp_path / "int8" / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert "Gemm" not in ops and ops.count("MatMulNBits") == meta["quant_report"]["quantized_matmuls"]
    # GLM-4: q, k, v, o, gate_up, down per layer, + the lm_head (a Gemm before the rewrite), less the recipe's
    # two fp32 down_proj (float_outliers)
    assert meta["quant_report"]["quantized_matmuls"] == 4 * 6 + 1 - 2
    assert len(meta["quant_report"]["float_outliers"]) == 2
    run = WholeModelRunner(tmp_path / "int8", threads=1).generate([5, 6, 7, 8], 3)
    assert len(run.token_ids) <= 3


def test_bad_quant_mode(tmp_path, tiny_glm4_lm):
    with pytest.raises(QuantizationError, match="int5"):
        export_whole(tiny_glm4_lm, tmp_path / "x", "int5")
