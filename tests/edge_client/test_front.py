"""edge_client.front: the ONNX front matches the torch layers, chunked or not, and its KV cache edits, on both
edge graphs (fused: in-place KV buffer through IO binding; plain: the traced portable fallback)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.front import FrontError, FrontRuntime
from shared.manifest import BundleError


@pytest.fixture(scope="module")
def plain_bundle(tiny_glm4_plain_bundle):
    """tiny-glm4 split at 2 with the plain traced graph (the conftest bundles get the fused one)."""
    return tiny_glm4_plain_bundle


@pytest.fixture(params=["fused", "plain"])
def bundle(request, tiny_bundle, plain_bundle):
    path = tiny_bundle if request.param == "fused" else plain_bundle
    assert FrontRuntime(path, threads=1).graph_kind == request.param
    return path


@pytest.fixture(scope="module")
def reference_hidden(tiny_reference):
    from partition_tools.adapters import ModelAdapter
    from partition_tools.split import boundary_hidden

    ids = np.random.RandomState(0).randint(4, 512, 40)
    ref = boundary_hidden(ModelAdapter(tiny_reference), torch.tensor(ids)[None], 2)[0].numpy()  # [S, H]
    return ids, ref


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_matches_torch_for_any_chunking(bundle, reference_hidden, chunk):
    ids, ref = reference_hidden
    rt = FrontRuntime(bundle, threads=1, chunk=chunk)
    h = rt.prefill(ids[:30])
    steps = [rt.decode(int(t)) for t in ids[30:]]
    got = np.concatenate([h, *steps])
    assert got.shape == ref.shape and rt.length == len(ids)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    assert rt.stats.tokens == len(ids) and rt.stats.forward_calls == -(-30 // chunk) + 10


def test_truncate_and_restore_prefix(bundle, reference_hidden):
    ids, ref = reference_hidden
    rt = FrontRuntime(bundle, threads=1, capacity=4)  # restoring 16 rows grows the fused buffer
    rt.prefill(ids)
    rt.truncate(16)
    np.testing.assert_allclose(rt.prefill(ids[16:]), ref[16:], atol=2e-5)
    saved = rt.kv_slice(0, 16)
    assert len(saved) == 2 * rt.n_layers and saved[0].shape == (rt.kv_heads, 16, rt.head_dim)
    rt.reset()
    assert rt.length == 0
    rt.extend_kv([saved])
    np.testing.assert_allclose(rt.prefill(ids[16:], start_pos=16), ref[16:], atol=2e-5)


def test_bad_input_is_refused(bundle):
    rt = FrontRuntime(bundle, threads=1)
    with pytest.raises(FrontError, match="out of range"):
        rt.prefill([1, 99999])
    with pytest.raises(FrontError, match="position"):
        rt.decode(5, pos=3)
    with pytest.raises(FrontError):
        rt.truncate(1)
    with pytest.raises(FrontError, match="KV block"):
        rt.extend_kv([[np.zeros((rt.kv_heads, 2, rt.head_dim), np.float32)]])
    with pytest.raises(ValueError):
        FrontRuntime(bundle, threads=0)


def test_fork_runs_an_independent_sequence(bundle, reference_hidden):
    ids, ref = reference_hidden
    rt = FrontRuntime(bundle, threads=1)
    rt.prefill(ids[:5])
    other = rt.fork()
    assert other.length == 0 and other.session is rt.session
    np.testing.assert_allclose(other.prefill(ids[:20]), ref[:20], atol=2e-5)
    np.testing.assert_allclose(rt.prefill(ids[5:20]), ref[5:20], atol=2e-5)


def test_tampered_graph_is_refused(tiny_bundle, tmp_path):
    import shutil

    bad = tmp_path / "b"
    shutil.copytree(tiny_bundle, bad)
    with open(bad / "edge" / "front.onnx", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(BundleError, match="sha256"):
        FrontRuntime(bad)


def test_a_swapped_calibration_is_refused_like_a_tampered_graph(tiny_bundle, tmp_path):
    """calibration.json (role shared) builds the edge's codecs: other outlier channels than the cloud's encode
    states the cloud decodes wrongly, and the answers turned to garbage with no error."""
    import json
    import shutil

    bad = tmp_path / "b"
    shutil.copytree(tiny_bundle, bad)
    calib = json.loads((bad / "calibration.json").read_text())
    calib["outlier_channels"] = [c + 1 for c in calib["outlier_channels"]]
    (bad / "calibration.json").write_text(json.dumps(calib))
    with pytest.raises(BundleError, match="calibration.json: "):
        FrontRuntime(bad)
