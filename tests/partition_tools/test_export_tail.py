"""``split --tail M`` (u-shape bundles): the tail graph reproduces the model's last layers + norm + lm_head, the
cloud half holds the middle only, the manifest records the tail, and ``inspect`` / ``verify`` know it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edge_client.front import FrontRuntime
from edge_client.tail import TAIL, TailRuntime
from partition_tools.cli import main
from partition_tools.cloud_half import CloudModel
from partition_tools.split import SplitConfig, split
from shared.manifest import BundleError, Manifest


def test_front_middle_tail_reproduce_the_unsplit_logits(tiny_glm4_ushape_bundle, tiny_glm4_lm):
    m = Manifest.load(tiny_glm4_ushape_bundle)
    assert (m.split_layer, m.tail_layers, m.cloud_layers) == (1, 2, (1, 2))
    assert TAIL in m.artifacts and m.artifacts[TAIL].role == "edge" and m.quant_report["tail"]["layers"] == [2, 4]
    ids = np.random.RandomState(0).randint(4, 512, 20)
    with torch.no_grad():
        ref = tiny_glm4_lm.model(torch.from_numpy(ids)[None]).logits[0].numpy()  # [T, V]
        middle = CloudModel.from_bundle(tiny_glm4_ushape_bundle)
        assert middle.returns_states and middle.lm_head is None and middle.num_layers == 1
        front = FrontRuntime(tiny_glm4_ushape_bundle).prefill(ids)  # [T, H]
        states = middle(torch.from_numpy(front)[None], torch.arange(20)[None])[0].numpy()  # [T, H]
    tail = TailRuntime(tiny_glm4_ushape_bundle, chunk=8)
    np.testing.assert_allclose(tail.run(states, 20), ref, atol=1e-5)
    # chunked prefill, then steps over the tail's in-place KV, then a rollback (rejected drafts)
    tail.reset()
    np.testing.assert_allclose(tail.prefill(states[:15]), ref[14:15], atol=1e-5)
    np.testing.assert_allclose(tail.run(states[15:], 5), ref[15:], atol=1e-5)
    tail.truncate(16)
    np.testing.assert_allclose(tail.run(states[16:18], 2), ref[16:18], atol=1e-5)
    assert tail.length == 18


def test_the_tail_is_part_of_the_bundle_id_and_the_cloud_keeps_a_layer(tiny_glm4_lm, tiny_glm4_ushape_bundle,
                                                                        tiny_glm4_fp32_bundle, tmp_path):
    # a plain bundle's manifest has no tail field (older clients read it); a u-shape one has it
    assert "tail_layers" not in json.loads((tiny_glm4_fp32_bundle / "manifest.json").read_text())
    ushape = Manifest.load(tiny_glm4_ushape_bundle)
    assert json.loads((tiny_glm4_ushape_bundle / "manifest.json").read_text())["tail_layers"] == 2
    with pytest.raises(BundleError, match="cloud must keep"):
        split(tiny_glm4_lm, SplitConfig(layer=2, out=tmp_path / "x", edge_quant="fp32", tail=2))
    same_but_no_tail = {**json.loads((tiny_glm4_ushape_bundle / "manifest.json").read_text()), "tail_layers": 0}
    del same_but_no_tail["bundle_id"]
    assert Manifest(**same_but_no_tail).compute_bundle_id() != ushape.bundle_id


def test_cli_split_tail_int8_inspect_verify(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["split", "--preset", "tiny-glm4", "--layer", "1", "--tail", "2", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "tail  : layers [2, 4) + norm + lm_head int8" in said and "cloud : layers [1, 2)," in said
    m = Manifest.load(out)
    assert m.quant_report["tail"]["mode"] == "int8" and m.quant_report["tail"]["quantized_matmuls"] == 2 * 4 + 1
    assert main(["inspect", str(out)]) == 0
    assert "u-shape    edge layers [0, 1) + [2, 4) + norm + lm_head" in capsys.readouterr().out
    assert main(["verify", str(out), "--json", "--max-tokens", "128"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["tail_layers"] == 2 and len(r["ushape_tokens"]) == 16


def test_verify_fp32_u_shape_matches_the_unsplit_greedy_tokens(tiny_glm4_ushape_bundle, capsys):
    assert main(["verify", str(tiny_glm4_ushape_bundle), "--json", "--max-tokens", "128"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["ushape_tokens"] == r["reference_tokens"] and r["top1_agreement"] > 0.99
