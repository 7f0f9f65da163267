"""partition_tools.kv_quant: the fused graph with an int8 KV cache (GroupQueryAttention's quantized cache)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.front import FrontRuntime
from partition_tools.quantize import QuantizationError, quantize_front


@pytest.fixture(scope="module")
def kv8(tiny_glm4_fp32_bundle, tmp_path_factory):
    path = tmp_path_factory.mktemp("kv8") / "front.onnx"
    ids = np.random.default_rng(5).integers(4, 512, 256)
    report = quantize_front(tiny_glm4_fp32_bundle / "edge" / "front.onnx", path, "fp32", kv_cache="int8",
                            calibration_ids=ids)
    assert report["kv_cache"] == "int8 PER_CHANNEL"
    return path


def test_int8_cache_stays_close_to_fp32(tiny_glm4_fp32_bundle, kv8):
    ids = np.random.default_rng(0).integers(4, 512, 40)
    ref_rt = FrontRuntime(tiny_glm4_fp32_bundle, threads=1)
    ref = np.concatenate([ref_rt.prefill(ids[:30])] + [ref_rt.decode(int(t)) for t in ids[30:]])
    rt = FrontRuntime(tiny_glm4_fp32_bundle, threads=1, graph=kv8, capacity=16)
    got = np.concatenate([rt.prefill(ids[:30])] + [rt.decode(int(t)) for t in ids[30:]])
    assert rt._cache.buffers[0].dtype == np.int8  # a quarter of the fp32 cache's bytes
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < rel < 0.1, rel
    # layer 0's rows (its input is exact) are the fp32 rows on the int8 grid of the graph's scales
    for j, (a, b) in enumerate(zip(ref_rt.kv_slice(0, 40)[:2], rt.kv_slice(0, 40)[:2])):
        scale = rt.kv_scales[j]  # [KVH, 1, D]
        assert b.dtype == np.float32
        assert np.abs(b - np.clip(np.rint(a / scale), -128, 127) * scale).max() <= scale.max() + 1e-6


def test_int8_cache_round_trips_through_kv_slice(tiny_glm4_fp32_bundle, kv8):
    ids = np.random.default_rng(1).integers(4, 512, 24)
    rt = FrontRuntime(tiny_glm4_fp32_bundle, threads=1, graph=kv8)
    h = rt.prefill(ids)
    saved = rt.kv_slice(0, 16)
    rt.reset()
    rt.extend_kv([saved])
    np.testing.assert_array_equal(np.concatenate(rt.kv_slice(0, 16)), np.concatenate(saved))
    np.testing.assert_allclose(rt.prefill(ids[16:]), h[16:], atol=1e-5)


def test_plain_graph_has_no_int8_cache(tiny_glm4_plain_bundle, tmp_path):
    src = tiny_glm4_plain_bundle / "edge" / "front.onnx"  # the traced plain graph (tests/conftest.py)
    with pytest.raises(QuantizationError, match="GroupQueryAttention"):
        quantize_front(src, tmp_path / "q.onnx", "fp32", kv_cache="int8", calibration_ids=np.arange(4, 40))
