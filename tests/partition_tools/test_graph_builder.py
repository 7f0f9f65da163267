"""partition_tools.graph_builder: the fused edge graph computes the torch layers, for every family it builds."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
import torch

from edge_client.front import FrontRuntime
from edge_client.rope import mrope_cos_sin
from partition_tools.adapters import ModelAdapter
from partition_tools.export import build_front
from partition_tools.graph_builder import GraphBuildError, build_fused_front
from partition_tools.models import load_model
from partition_tools.split import SplitConfig, boundary_hidden, split
from shared.manifest import Manifest

N = 2


@pytest.fixture(scope="module")
def llama16_dir(tmp_path_factory):
    """A tiny Llama with head_dim 16 (GroupQueryAttention needs a multiple of 8; conftest's has 12)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    d = tmp_path_factory.mktemp("ckpt-llama16")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def fused(llama16_dir, tmp_path_factory, tiny_glm4_lm, tiny_glm4_fp32_bundle, tiny_glm4v_lm,
          tiny_glm4v_fp32_bundle):
    """family -> (adapter, fused fp32 bundle split at N), built once per module on first use. The presets' are
    the session's fp32 bundles at layer N (tests/conftest.py: ``auto`` builds the fused graph for both)."""

    @functools.cache
    def get(family: str):
        if family == "llama":
            lm = load_model(str(llama16_dir))
            out = tmp_path_factory.mktemp(f"fused-{family}") / "b"
            m = split(lm, SplitConfig(layer=N, out=out, edge_quant="fp32", edge_graph="fused"))
        else:
            lm, out = {"tiny-glm4": (tiny_glm4_lm, tiny_glm4_fp32_bundle),
                       "tiny-glm4v": (tiny_glm4v_lm, tiny_glm4v_fp32_bundle)}[family]
            m = Manifest.load(out)
            assert m.split_layer == N and m.edge_quant == "fp32"
        assert m.quant_report["edge_graph"] == "fused"
        return ModelAdapter(lm.model), out

    return get


def _reference(adapter: ModelAdapter, ids: np.ndarray) -> np.ndarray:
    return boundary_hidden(adapter, torch.tensor(ids)[None], N)[0].numpy()  # [S, H]


@pytest.mark.parametrize("family", ["llama", "tiny-glm4", "tiny-glm4v"])
def test_fused_graph_matches_torch_prefill_and_decode(fused, family):
    """Llama layout (fused rotary in GQA), GLM-4 (partial interleaved rotary via RotaryEmbedding, post
    norms), GLM-4.1V (3-D rope: cos/sin as graph inputs); chunked prefill, decode, and buffer growth."""
    adapter, bundle = fused(family)
    ids = np.random.default_rng(0).integers(4, adapter.vocab_size, 40)
    ref = _reference(adapter, ids)
    rt = FrontRuntime(bundle, threads=1, chunk=7, capacity=8)  # 8 rows: the buffer grows twice
    assert rt.graph_kind == "fused"
    got = np.concatenate([rt.prefill(ids[:30])] + [rt.decode(int(t)) for t in ids[30:]])
    np.testing.assert_allclose(got, ref, atol=3e-5 * max(1.0, float(np.abs(ref).max())))


def test_graph_is_made_of_fused_ops(fused):
    _, bundle = fused("tiny-glm4")
    ops = [n.op_type for n in onnx.load(str(bundle / "edge" / "front.onnx")).graph.node]
    assert ops.count("GroupQueryAttention") == N and ops.count("MatMul") == 4 * N
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * N - 1
    assert "Concat" not in ops and "Transpose" not in ops


def test_decode_writes_the_kv_buffer_in_place(fused):
    """The step's K/V land in the bound buffer itself: no new arrays, nothing copied per step."""
    _, bundle = fused("llama")
    rt = FrontRuntime(bundle, threads=1, capacity=64)
    rt.prefill([5, 6, 7, 8])
    buf = rt._cache.buffers[0]
    before = buf.ctypes.data
    rt.decode(9)
    assert rt._cache.buffers[0] is buf and buf.ctypes.data == before
    np.testing.assert_array_equal(buf[0, :, 4], rt.kv_slice(4, 5)[0][:, 0])
    assert np.abs(buf[0, :, 4]).sum() > 0 and np.abs(buf[0, :, 5:]).sum() == 0


def test_truncate_rolls_back_a_speculative_step_exactly(fused):
    """Decode 3 draft tokens, reject them (truncate), decode others: same as never having drafted."""
    adapter, bundle = fused("tiny-glm4")
    ids = np.random.default_rng(1).integers(4, adapter.vocab_size, 20)
    rt = FrontRuntime(bundle, threads=1)
    rt.prefill(ids[:16])
    for t in (3, 4, 5):
        rt.decode(t)
    rt.truncate(16)
    got = np.concatenate([rt.decode(int(t)) for t in ids[16:]])
    np.testing.assert_allclose(got, _reference(adapter, ids)[16:], atol=3e-5)


def test_mrope_angles_match_the_model_rotary_module(tiny_glm4v_lm):
    """edge_client.rope reproduces GLM-4.1V's own 3-D rope for distinct (t, h, w) positions."""
    adapter = ModelAdapter(tiny_glm4v_lm.model)
    rope = adapter.rope_settings()
    pos = np.stack([np.arange(10), np.arange(10) // 3 + 50, np.arange(10) % 4 + 7])  # [3, S]
    rot = int(adapter.head_dim * rope["partial_rotary_factor"])
    cos, sin = mrope_cos_sin(pos, rope["theta"], rot, rope["mrope_section"])
    ref_cos, ref_sin = adapter.rotary_emb(torch.zeros(1, 1, adapter.hidden_size), torch.tensor(pos)[:, None])
    np.testing.assert_allclose(cos, ref_cos[0, :, ::2].numpy(), atol=1e-6)  # halves are repeat-interleaved
    np.testing.assert_allclose(sin, ref_sin[0, :, ::2].numpy(), atol=1e-6)


def test_unsupported_layout_falls_back_to_the_plain_graph(tmp_path):
    adapter = ModelAdapter(load_model("tiny-glm4").model)
    adapter.config.hidden_act = "gelu"
    with pytest.raises(GraphBuildError, match="gelu"):
        build_fused_front(adapter, N, tmp_path / "f.onnx")
    with pytest.raises(GraphBuildError):
        build_front(adapter, N, tmp_path / "f.onnx", graph="fused")
    path, kind = build_front(adapter, N, tmp_path / "p.onnx", graph="auto")
    assert kind == "plain" and "position_ids" in {i.name for i in onnx.load(str(path)).graph.input}
    with pytest.raises(ValueError, match="edge graph"):
        build_front(adapter, N, tmp_path / "x.onnx", graph="fast")


@pytest.mark.slow  # test_unsupported_layout_falls_back_to_the_plain_graph keeps the fallback in the default suite
def test_head_dim_gqa_cannot_run_falls_back_to_plain(llama_dir, tmp_path):
    """conftest's Llama has head_dim 12: auto writes the plain graph, and a split with it still works."""
    lm = load_model(str(llama_dir))
    m = split(lm, SplitConfig(layer=N, out=tmp_path / "b", edge_quant="fp32"))
    assert m.quant_report["edge_graph"] == "plain"
    assert FrontRuntime(tmp_path / "b", threads=1).graph_kind == "plain"
