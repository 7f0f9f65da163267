"""Source identities: a moved or renamed checkpoint is the same model, a fine-tune of the same shape is not.

The identity of a checkpoint directory was ``dir:<folder>#<hash of config (its path included), file names and
sizes>``: moving or renaming the folder made ``verify`` and ``draft-head`` refuse the very checkpoint a bundle was
split from, and other weights saved in its place (a fine-tune of one architecture) were the same model to them and
to the edge's bundle updates (``edge_client.bundle_sync.choose``)."""

import shutil
from dataclasses import replace

from edge_client import bundle_sync
from partition_tools.models import load_model, source_identity
from shared.manifest import Manifest, same_source


def _reseeded(src, dst, seed: int):
    """A checkpoint of ``src``'s architecture (same config, file names and sizes) with other weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(dst)
    return dst


def test_a_renamed_copy_is_the_same_model_and_other_weights_are_not(llama_dir, tmp_path):
    original = load_model(str(llama_dir)).identity
    assert source_identity(str(llama_dir)) == original  # what the rig checks a scenario's bundle against, unloaded
    assert source_identity("tiny-glm4") == load_model("tiny-glm4").identity
    moved = load_model(str(shutil.copytree(llama_dir, tmp_path / "renamed-elsewhere"))).identity
    assert original != moved and original.startswith("dir:") and "+" in original  # the folder's name shows
    assert same_source(original, moved) and same_source(moved, original)
    tuned = load_model(str(_reseeded(llama_dir, tmp_path / "fine-tune", 1))).identity
    assert not same_source(tuned, original) and not same_source(original, tuned)
    in_place = load_model(str(_reseeded(llama_dir, tmp_path / "renamed-elsewhere", 2))).identity  # saved over it
    assert in_place.partition("+")[0] == moved.partition("+")[0]  # the old identity could not tell them apart
    assert not same_source(in_place, moved)
    # a manifest written before content hashes carries the metadata hash alone (which covered the folder's path):
    # it still matches the model loaded from that folder
    legacy = original.partition("+")[0]
    assert same_source(original, legacy) and same_source(legacy, original)


def test_same_source_rules():
    assert same_source("gguf:a.gguf#0123", "gguf:renamed.gguf#0123")
    assert not same_source("gguf:a.gguf#0123", "gguf:a.gguf#4567")
    assert same_source("preset:tiny-glm4@seed0", "preset:tiny-glm4@seed0")
    assert not same_source("preset:tiny-glm4@seed0", "preset:tiny-glm4@seed1")
    assert not same_source("dir:x#aa+bb", "gguf:x#aa+bb")  # other kinds never match
    assert not same_source("dir:x#aa+bb", "dir:x#aa+cc") and same_source("dir:x#aa+bb", "dir:y#zz+bb")
    assert not same_source("None", "dir:x#aa+bb") and not same_source("dir:x", "dir:x#aa")


def test_bundle_updates_follow_the_model_not_its_folder(tiny_glm4_fp32_bundle):
    """The server's listing names a renamed copy's identity: still the same model, so the edge may update."""
    m = replace(Manifest.load(tiny_glm4_fp32_bundle), source_identity="dir:ckpt#aaaa+bbbb")
    entry = {"id": "f" * 32, "architecture": m.architecture, "edge_variants": [{"edge_quant": "fp32"}]}
    assert bundle_sync.choose(m, [{**entry, "source_identity": "dir:moved#aaaa+bbbb"}]) == ("f" * 32, "fp32")
    try:
        bundle_sync.choose(m, [{**entry, "source_identity": "dir:ckpt#aaaa+cccc"}])
    except bundle_sync.BundleSyncError as e:
        assert e.code == "other_model"
    else:
        raise AssertionError("a bundle of other weights was chosen")
