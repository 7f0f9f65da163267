"""partition_tools.draft_layers: the exported layer-skipping drafter computes what torch computes for its layer
subset (skipped layers absent, its own KV, chunked and truncated), a --vocab drafter proposes from its
vocabulary, the greedy search is nested and reaches the model itself with every layer, and a bundle gets the
drafter with its manifest entry (bundle id unchanged; a missing or bad file is a clear error)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from edge_client.draft_head import open_draft_head
from edge_client.draft_layers import DRAFT_LAYERS, LayerDrafter
from edge_client.front import FrontRuntime
from partition_tools.adapters import ModelAdapter, call_layer
from partition_tools.cli import main
from partition_tools.draft_layers import (DraftLayersConfig, LayerProbe, Sequences, add_draft_layers,
                                          export_drafter, search)
from shared.manifest import BundleError, Manifest

SPLIT = 2  # tiny_glm4_fp32_bundle: layers [0, 2) on the edge, [2, 4) in the cloud


@torch.no_grad()
def _torch_logits(adapter: ModelAdapter, ids: np.ndarray, layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(h_N [T, H], logits [T, V]) of the drafter through ``layers``, in torch."""
    x = adapter.embed_tokens(torch.from_numpy(ids)[None])
    pos = torch.arange(ids.size)[None]
    cos_sin = adapter.position_embeddings(x, pos)
    run = lambda x, i: call_layer(adapter.layers[i], x, attention_mask=None, position_ids=pos,  # noqa: E731
                                  position_embeddings=cos_sin)
    for i in range(SPLIT):
        x = run(x, i)
    h = x[0].numpy().copy()
    for i in layers:
        x = run(x, i)
    return h, adapter.lm_head(adapter.norm(x))[0].numpy()


def test_exported_subset_matches_torch_with_its_own_kv(tiny_glm4_lm, tiny_glm4_fp32_bundle, tmp_path):
    adapter = ModelAdapter(tiny_glm4_lm.model)
    ids = np.random.RandomState(0).randint(4, 512, 24)
    h, ref = _torch_logits(adapter, ids, [3])  # layer 2 skipped
    export_drafter(adapter, [3], tmp_path / "d.onnx", "fp32")
    d = LayerDrafter(tmp_path / "d.onnx", Manifest.load(tiny_glm4_fp32_bundle), 1, chunk=8)
    np.testing.assert_allclose(d.graph.run(h, 24), ref, atol=1e-4)
    d.reset()
    assert d.next_tokens(h).tolist() == ref.argmax(-1).tolist()
    # the drafting interface: a prompt in chunks, steps, a rejection (truncation), steps again
    d.reset()
    d.note(0, ids[:15].tolist(), h[:15])
    assert d.propose() == int(ref[14].argmax()) and d.graph.length == 15
    for p in range(15, 20):
        d.note(p, [int(ids[p])], h[p:p + 1])
        assert d.propose() == int(ref[p].argmax())
    d.note(17, ids[17:18].tolist(), h[17:18])  # positions 18, 19 rejected: the mirror ends at 18
    assert d.length == 18 and d.propose() == int(ref[17].argmax())
    d.note(18, ids[18:22].tolist(), h[18:22])
    assert d.propose() == int(ref[21].argmax()) and d.graph.length == 22
    # a new context sharing 10 tokens keeps their KV; a different token at 10 replaces the rest
    other = ids.copy()
    other[10] = (other[10] + 1) % 512
    h2, ref2 = _torch_logits(adapter, other, [3])
    d.note(0, other[:16].tolist(), h2[:16])
    assert d.graph.length == 10 and d.propose() == int(ref2[15].argmax())


def test_a_vocab_drafter_proposes_from_its_vocabulary(tiny_glm4_lm, tiny_glm4_fp32_bundle, tmp_path):
    adapter = ModelAdapter(tiny_glm4_lm.model)
    ids = np.random.RandomState(1).randint(4, 512, 12)
    h, ref = _torch_logits(adapter, ids, [2, 3])
    vocab = np.arange(100, 300, dtype=np.int64)
    export_drafter(adapter, [2, 3], tmp_path / "v.onnx", "fp32", vocab)
    d = LayerDrafter(tmp_path / "v.onnx", Manifest.load(tiny_glm4_fp32_bundle), 2)
    assert d.next_tokens(h).tolist() == vocab[ref[:, vocab].argmax(-1)].tolist()


def test_greedy_search_is_nested_and_all_layers_are_the_model(tiny_glm4_lm):
    adapter = ModelAdapter(tiny_glm4_lm.model)
    seqs = Sequences()
    gen = torch.Generator().manual_seed(0)
    for n in (300, 40, 90, 90, 17):  # sequences of several lengths, right-padded into shared batches
        seqs.add(torch.randint(4, 512, (n,), generator=gen), torch.rand(n, generator=gen) < 0.7)
    probe = LayerProbe(adapter, seqs, 1, batch_tokens=200)  # candidates: layers 1, 2, 3
    assert len(probe.batches) == 3 and sorted(probe.order) == list(range(5))  # [300], [90, 90], [40, 17]
    with torch.no_grad():  # the targets are the model's greedy next tokens, sequence by sequence
        want = [tiny_glm4_lm.model(seqs.ids[i][None]).logits[0].argmax(-1)[seqs.scored[i]] for i in probe.order]
    assert torch.equal(probe.targets, torch.cat(want))
    steps = search(probe, 3)
    assert [len(s["layers"]) for s in steps] == [1, 2, 3] and steps[-1]["layers"] == [1, 2, 3]
    assert all(set(a["layers"]) < set(b["layers"]) for a, b in zip(steps, steps[1:]))
    assert steps[-1]["calibration_agreement"] == 1.0
    # the first pick is the best single layer on the search's score
    best = max(probe.candidates, key=lambda j: probe.score(probe._run([j], probe.boundary()), exact=False))
    assert steps[0]["layers"] == [best]
    with pytest.raises(BundleError):
        search(probe, 4)


def test_prose_windows_fit_a_model_of_a_shorter_context():
    """A checkpoint of a 256-token context: the held-out and calibration prose came in windows of 512, more than its
    exported front holds - draft-head --layers ended in a FrontError traceback ('384 positions exceed the edge
    graph's 256') as it scored the drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from partition_tools.draft_layers import calibration, held_out_prose
    from partition_tools.models import LoadedModel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    lm = LoadedModel(model.eval(), None, "test:short-context", "test")
    adapter = ModelAdapter(lm.model)
    for seqs in (held_out_prose(lm, adapter), calibration(lm, adapter, DraftLayersConfig())):
        assert max(ids.numel() for ids in seqs.ids) == 256


def test_add_draft_layers_to_a_bundle(tiny_glm4_fp32_bundle, tiny_glm4_lm, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    before = Manifest.load(bundle)
    report = add_draft_layers(tiny_glm4_lm, bundle, DraftLayersConfig(budget=1, prose_tokens=512, quant="fp32"))
    after = Manifest.load(bundle)
    assert after.bundle_id == before.bundle_id and DRAFT_LAYERS in after.artifacts
    assert after.quant_report["draft_layers"] == report and len(report["layers"]) == 1
    assert report["layers"][0] in (2, 3) and report["chosen_by"].startswith("greedy")
    # fp32 throughout: the exported graph, fed by the bundle's front, agrees with torch's number
    assert report["held_out_top1_agreement"] == pytest.approx(report["held_out_top1_agreement_torch_fp32"], abs=0.01)
    after.verify_files(bundle, roles=("edge",))
    drafter = open_draft_head(bundle, after)
    assert isinstance(drafter, LayerDrafter) and drafter.kind == "layers"
    with pytest.raises(BundleError, match="u-shape"):
        ushape = Manifest.load(bundle)
        ushape.tail_layers = 1
        ushape.save(bundle)
        add_draft_layers(tiny_glm4_lm, bundle, DraftLayersConfig(layers=(2,)))


def test_missing_or_bad_drafter_files_are_clear_errors(tiny_glm4_fp32_bundle, tiny_glm4_lm, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    add_draft_layers(tiny_glm4_lm, bundle, DraftLayersConfig(layers=(3,), prose_tokens=512, quant="fp32"))
    m = Manifest.load(bundle)
    (bundle / DRAFT_LAYERS).write_bytes(b"not an onnx graph")
    with pytest.raises(BundleError, match="draft_layers.onnx"):
        FrontRuntime(bundle)  # the hash check of the edge's files
    with pytest.raises(BundleError, match="onnxruntime cannot load it"):
        open_draft_head(bundle, m)
    (bundle / DRAFT_LAYERS).unlink()
    with pytest.raises(BundleError, match="missing"):
        open_draft_head(bundle, m)
    del m.quant_report["draft_layers"]
    with pytest.raises(BundleError, match="records no draft layers"):
        open_draft_head(bundle, m)


def test_cli_adds_a_layer_drafter_and_refuses_bad_layers(tiny_glm4_fp32_bundle, tmp_path, capsys):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    assert main(["draft-head", str(bundle), "--layers", "3", "--quant", "fp32", "--vocab", "64"]) == 0
    said = capsys.readouterr().out
    assert "layers [3] (given)" in said and "64 tokens" in said
    assert Manifest.load(bundle).quant_report["draft_layers"]["vocab"] == 64
    for bad in ("1,3", "x", "3,3"):  # a front layer, not a number, twice the same
        assert main(["draft-head", str(bundle), "--layers", bad]) == 2
        assert "layers" in capsys.readouterr().err


def test_chat_answers_are_the_models_greedy_tokens(smollm2_lm):
    from partition_tools.draft_layers import chat_answers, read_prompts

    prompts = read_prompts()[:3]
    seqs = chat_answers(smollm2_lm, prompts, 6)  # one left-padded batch
    assert len(seqs.ids) == 3 and seqs.scored_tokens <= 3 * 6
    probe = LayerProbe(ModelAdapter(smollm2_lm.model), seqs, 8)
    answers = torch.cat([seqs.ids[i][1:][seqs.scored[i][:-1]] for i in probe.order])
    # each scored position predicts its answer token: the model's greedy one (padding changed nothing)
    assert (answers == probe.targets).float().mean() >= 0.9
