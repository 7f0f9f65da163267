"""edge_client.front, precision by phase: the prompt runs through the bundle's fp32 prefill graph, decode steps
and speculative steps through the quantized graph, both on one KV cache; the prefix keys name the variant."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_client.front import FRONT, PREFILL_GRAPH, FrontRuntime, prefill_graph_path
from shared.manifest import BundleError, Manifest
from shared.prefix_keys import KeyScope, block_keys


@pytest.fixture(scope="module")
def phased_bundle(split_bundle, tiny_glm4_lm):
    """tiny-glm4 split at 2 with the int8 edge and its fp32 prefill graph (``split --fp32-prefill``)."""
    return split_bundle("tiny-glm4-int8-phased", tiny_glm4_lm, 2, "int8", fp32_prefill=True)


@pytest.fixture(scope="module")
def one_graph_bundle(tiny_int8_bundle):
    """The default int8 edge: one graph for the prompt and the decode steps."""
    return tiny_int8_bundle


IDS = np.random.RandomState(5).randint(4, 512, 24)


def test_a_phased_bundle_carries_an_fp32_prefill_graph(phased_bundle, one_graph_bundle):
    m = Manifest.load(phased_bundle)
    assert PREFILL_GRAPH in m.artifacts and m.artifacts[PREFILL_GRAPH].role == "edge"
    assert m.quant_report["prefill"]["mode"] == "fp32" and m.quant_report["prefill"]["embedding"].startswith("int8")
    assert m.edge_variant == "int8+fp32-prefill"
    one = Manifest.load(one_graph_bundle)
    assert PREFILL_GRAPH not in one.artifacts and "prefill" not in one.quant_report and one.edge_variant == "int8"
    assert one.bundle_id == m.bundle_id  # the same cloud half
    assert FrontRuntime(phased_bundle, threads=1).phased and not FrontRuntime(one_graph_bundle, threads=1).phased


def test_prompt_runs_the_prefill_graph_and_steps_the_decode_graph(phased_bundle):
    rt = FrontRuntime(phased_bundle, threads=1, chunk=7)
    prompt_only = FrontRuntime(phased_bundle, threads=1, chunk=7, graph=phased_bundle / PREFILL_GRAPH,
                               prefill_graph=None)
    decode_only = FrontRuntime(phased_bundle, threads=1, chunk=7, prefill_graph=None)
    assert not decode_only.phased
    h = rt.prefill(IDS[:16])  # [16, H]
    np.testing.assert_array_equal(h, prompt_only.prefill(IDS[:16]))
    assert np.abs(h - decode_only.prefill(IDS[:16])).max() > 1e-4  # the int8 graph computes otherwise
    decode_only.reset()
    decode_only.extend_kv([rt.kv_slice(0, 16)])  # the prompt's fp32 KV, continued in the int8 graph alone
    np.testing.assert_array_equal(rt.decode(int(IDS[16])), decode_only.decode(int(IDS[16])))
    np.testing.assert_array_equal(rt.step(IDS[17:21]), decode_only.step(IDS[17:21]))  # a speculative step
    assert rt.length == decode_only.length == 21
    np.testing.assert_array_equal(rt.kv_slice(0, 21)[3], decode_only.kv_slice(0, 21)[3])  # one shared cache
    rt.truncate(16)  # a rejected step: the next call continues from the prompt in the right graph
    np.testing.assert_array_equal(rt.prefill(IDS[16:18]), prompt_only.prefill(IDS[16:18]))
    other = rt.fork()
    assert other.phased and other.length == 0
    np.testing.assert_array_equal(other.prefill(IDS[:16]), h)


def test_step_without_a_prefill_graph_is_one_prefill_chunk(one_graph_bundle):
    a = FrontRuntime(one_graph_bundle, threads=1, chunk=64)
    b = FrontRuntime(one_graph_bundle, threads=1, chunk=64)
    np.testing.assert_array_equal(a.step(IDS), b.prefill(IDS))
    assert a.step([]).shape == (0, a.hidden_size) and a.stats.forward_calls == 1


def test_a_prefill_graph_with_other_inputs_is_refused(phased_bundle, tiny_glm4_plain_bundle, tmp_path):
    plain = Manifest.load(tiny_glm4_plain_bundle)  # tiny-glm4 at 2, fp32, the plain graph (tests/conftest.py)
    assert plain.edge_variant == "fp32" and plain.quant_report["edge_graph"] == "plain"
    with pytest.raises(BundleError, match="differ from the edge graph"):
        FrontRuntime(phased_bundle, threads=1, prefill_graph=tiny_glm4_plain_bundle / FRONT)
    d = tmp_path / "b"
    shutil.copytree(phased_bundle, d)
    (d / PREFILL_GRAPH).unlink()
    with pytest.raises(BundleError, match="front_prefill.onnx: missing"):
        FrontRuntime(d, threads=1, verify=False)


def test_prefix_keys_tell_the_phased_front_from_the_one_graph_front(phased_bundle, one_graph_bundle):
    keys = [block_keys(list(IDS), KeyScope(m.bundle_id, m.edge_variant, "fp16"), 8)
            for m in (Manifest.load(phased_bundle), Manifest.load(one_graph_bundle))]
    assert len(keys[0]) == 3 and not set(keys[0]) & set(keys[1])


def test_prefill_graph_path_is_beside_the_graph(tmp_path):
    assert prefill_graph_path(tmp_path / "edge" / "front.onnx") == tmp_path / "edge" / "front_prefill.onnx"
    assert prefill_graph_path("arms/int8.onnx").name == "int8_prefill.onnx"


def test_a_phased_multimodal_front_takes_media_rows_in_both_graphs(split_bundle, tiny_glm4v_lm):
    """GLM-4.1V (3-D rope, the embeddings input): both graphs get the media input; a media prompt runs the
    prefill graph, the next token the decode graph, on one cache."""
    bundle = split_bundle("tiny-glm4v-int8-phased", tiny_glm4v_lm, 2, "int8", fp32_prefill=True)
    rt = FrontRuntime(bundle, threads=1, chunk=5)
    alone = FrontRuntime(bundle, threads=1, chunk=5, graph=bundle / PREFILL_GRAPH, prefill_graph=None)
    assert rt.phased and rt.embeds_input and rt.mrope
    ids = IDS[:12]
    embeds = np.random.default_rng(2).standard_normal((12, rt.hidden_size)).astype(np.float32)
    mask = np.zeros(12, np.bool_)
    mask[3:7] = True
    positions = np.stack([np.arange(12)] * 3)  # [3, S]
    np.testing.assert_array_equal(rt.prefill_media(ids, positions, embeds, mask),
                                  alone.prefill_media(ids, positions, embeds, mask))
    assert rt.decode(int(IDS[12])).shape == (1, rt.hidden_size) and rt.length == 13
