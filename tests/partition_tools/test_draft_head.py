"""partition_tools.draft_head: the ridge lens is exact on a linear relation, the vocabulary is the most
frequent calibration tokens, and a bundle gets an ONNX head the phone runs (manifest records it, the bundle
id is unchanged: the cloud half is the same)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_client.draft_head import DRAFT_HEAD, DraftHead, open_draft_head
from partition_tools.draft_head import DraftHeadConfig, LensFit, add_draft_head, export, fit
from shared.manifest import BundleError, Manifest


def test_fit_recovers_a_linear_map_and_ranks_the_vocabulary():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((400, 6)).astype(np.float32)  # [T, H]
    w, b = rng.standard_normal((6, 6)), rng.standard_normal(6)
    y = (h @ w + b).astype(np.float32)
    nxt = np.array([3] * 200 + [1] * 150 + [7] * 50)
    lm_head = rng.standard_normal((10, 6)).astype(np.float32)  # [V, H]
    lens = fit(h, y, nxt, lm_head, DraftHeadConfig(ridge=0.0, vocab=2))
    assert np.allclose(lens.weight, w, atol=1e-3) and np.allclose(lens.bias, b, atol=1e-3)
    assert lens.vocab.tolist() == [1, 3] and np.array_equal(lens.head, lm_head[[1, 3]].T)
    assert fit(h, y, nxt, lm_head, DraftHeadConfig()).vocab.size == 10  # None: the whole vocabulary


@pytest.mark.parametrize("quant", ["fp32", "int8"])
def test_exported_graph_proposes_the_argmax_of_its_vocabulary(tmp_path, quant):
    rng = np.random.default_rng(1)
    lens = LensFit(np.eye(8, dtype=np.float32), np.zeros(8, np.float32), np.array([5, 9, 11, 40]),
                   np.eye(8, 4, dtype=np.float32))  # slot j scores channel j
    export(lens, tmp_path / "h.onnx", quant)
    hidden = rng.standard_normal((16, 8)).astype(np.float32)  # [S, H]
    got = DraftHead(tmp_path / "h.onnx").next_tokens(hidden)
    assert got.tolist() == lens.vocab[hidden[:, :4].argmax(1)].tolist()


def test_the_int8_export_logs_no_preprocessing_advice(tmp_path, caplog):
    """autoglm-partition draft-head printed onnxruntime's 'WARNING:root:Please consider to run pre-processing
    before quantization' on every run: advice for image models that asked nothing of the user."""
    import logging

    lens = LensFit(np.eye(8, dtype=np.float32), np.zeros(8, np.float32), np.array([5, 9, 11, 40]),
                   np.eye(8, 4, dtype=np.float32))
    with caplog.at_level(logging.WARNING):
        export(lens, tmp_path / "h.onnx", "int8")
    assert not [r for r in caplog.records if "pre-processing" in r.getMessage()]
    assert not logging.getLogger().filters  # the filter is gone after the export


def test_add_draft_head_to_a_bundle(tiny_glm4_fp32_bundle, tiny_glm4_lm, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    before = Manifest.load(bundle)
    assert open_draft_head(bundle, before) is None
    report = add_draft_head(tiny_glm4_lm, bundle, DraftHeadConfig(tokens=1024, vocab=100))
    after = Manifest.load(bundle)
    assert after.bundle_id == before.bundle_id and DRAFT_HEAD in after.artifacts
    assert after.quant_report["draft_head"] == report and report["vocab"] == 100
    assert 0.0 <= report["held_out_top1_agreement"] <= 1.0
    after.verify_files(bundle, roles=("edge",))
    head = open_draft_head(bundle, after)
    assert 0 <= head.next_token(np.zeros(after.hidden_size, np.float32)) < after.vocab_size


def test_bad_configs_are_refused():
    with pytest.raises(BundleError):
        DraftHeadConfig(quant="int4")
    with pytest.raises(BundleError):
        DraftHeadConfig(vocab=0)


def test_cli_adds_a_draft_head(tiny_glm4_fp32_bundle, tmp_path, capsys):
    from partition_tools.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    assert main(["draft-head", str(bundle), "--vocab", "64", "--quant", "fp32"]) == 0
    assert "64 tokens, fp32" in capsys.readouterr().out
    assert Manifest.load(bundle).quant_report["draft_head"]["vocab"] == 64


@pytest.mark.parametrize("kind, steps", [([], 4), (["--layers", "3"], 5), (["--cloud"], 4)],
                         ids=["head", "layers", "cloud"])
def test_draft_head_shows_its_steps(kind, steps, tiny_glm4_fp32_bundle, tmp_path, capsys, monkeypatch):
    """draft-head (minutes on a real model: the reload, calibration forward passes, a layer search) ran without a word
    until its report, where split, verify and plan print a line per step on stderr (AUTOGLM_PROGRESS)."""
    from partition_tools.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    monkeypatch.setenv("AUTOGLM_PROGRESS", "1")
    assert main(["draft-head", str(bundle), *kind]) == 0
    err = capsys.readouterr().err
    assert f"[draft-head 1/{steps}] load tiny-glm4" in err and f"[draft-head {steps}/{steps}] held-out agreement" in err
    assert "[draft-head] done in " in err, err
    monkeypatch.setenv("AUTOGLM_PROGRESS", "0")
    assert main(["draft-head", str(bundle), *kind]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", [[], ["--layers", "3"], ["--cloud"]], ids=["head", "layers", "cloud"])
def test_cli_refuses_a_source_that_is_another_model_of_the_same_shape(tiny_glm4_fp32_bundle, tmp_path, capsys,
                                                                      kind):
    """tiny-glm4v's text decoder has tiny-glm4's hidden size and layers: the shape check passed it, and every
    drafter kind was fit on the wrong weights. The model's identity (the manifest's ``source_identity``) refuses
    it: one line, exit 2, the bundle untouched."""
    from partition_tools.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    before = (bundle / "manifest.json").read_bytes()
    assert main(["draft-head", str(bundle), "--source", "tiny-glm4v", *kind]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoglm-partition draft-head: error: ") and err.count("\n") == 1, err
    assert "not split from tiny-glm4v" in err and "preset:tiny-glm4v@seed0" in err and "preset:tiny-glm4@seed0" in err
    assert (bundle / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("kind", [[], ["--layers", "1"], ["--cloud"]], ids=["head", "layers", "cloud"])
def test_cli_refuses_every_drafter_for_a_u_shape_bundle(tiny_glm4_ushape_bundle, tmp_path, capsys, kind):
    """A u-shape bundle's requests draft by prompt lookup only: --layers and --cloud refused it, but the default
    lens was fit, written and hashed into the bundle (every client then opened it), and never run."""
    from partition_tools.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_ushape_bundle, bundle)
    before = (bundle / "manifest.json").read_bytes()
    assert main(["draft-head", str(bundle), *kind]) == 2
    err = capsys.readouterr().err
    assert err == (f"autoglm-partition draft-head: error: {bundle}: a u-shape bundle (split with --tail) drafts by "
                   "prompt lookup only; it takes no drafter\n"), err
    assert (bundle / "manifest.json").read_bytes() == before and not (bundle / DRAFT_HEAD).exists()


def test_cli_accepts_the_source_named_by_its_identity(tiny_glm4_fp32_bundle, tmp_path, capsys):
    from partition_tools.cli import main

    bundle = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, bundle)
    assert main(["draft-head", str(bundle), "--source", "tiny-glm4", "--vocab", "32"]) == 0
    assert "32 tokens" in capsys.readouterr().out
