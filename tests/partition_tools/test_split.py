import json

import pytest
import torch

from edge_client.front import FrontRuntime
from partition_tools.adapters import ModelAdapter
from partition_tools.cloud_half import CloudModel
from partition_tools.models import load_model
from partition_tools.split import SplitConfig, split
from shared.manifest import BundleError, Manifest


def _split_matches_unsplit(source: str, layer: int, out, quant: str = "fp32") -> None:
    lm = load_model(source)
    split(lm, SplitConfig(layer=layer, out=out, edge_quant=quant))
    _recombines_exactly(lm, out)


def _recombines_exactly(lm, out) -> None:
    """Front (ONNX) then cloud half (torch) of the bundle ``out`` give the unsplit model's logits."""
    ad = ModelAdapter(lm.model)
    ids = torch.randint(4, ad.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = lm.model(input_ids=ids).logits[0]  # [S, V]
    hidden = torch.from_numpy(FrontRuntime(out).prefill(ids[0].numpy()))[None]  # [1, S, H]
    logits = CloudModel.from_bundle(out)(hidden, torch.arange(11)[None])[0]
    assert torch.allclose(logits, ref, atol=1e-4), float((logits - ref).abs().max())


@pytest.mark.parametrize("source", ["tiny-glm4", "tiny-glm4v"])
def test_presets_split_and_recombine_exactly(source, request):
    """The session's fp32 splits at layer 2 (tests/conftest.py: ``split`` of the loaded preset)."""
    name = source.replace("-", "_")
    _recombines_exactly(request.getfixturevalue(f"{name}_lm"), request.getfixturevalue(f"{name}_fp32_bundle"))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_checkpoint_dirs_split_and_recombine(kind, request, tmp_path):
    ckpt = request.getfixturevalue(f"{kind}_dir")
    _split_matches_unsplit(str(ckpt), 1, tmp_path / "b")


def test_manifest_records_model_and_hashes(tiny_glm4_bundle):
    m = Manifest.load(tiny_glm4_bundle)
    assert (m.split_layer, m.num_layers, m.hidden_size, m.num_kv_heads, m.head_dim) == (2, 4, 64, 2, 16)
    assert m.eos_token_ids == [2, 3] and m.architecture == "glm4" and m.edge_quant == "int8"
    assert set(m.artifacts) >= {"edge/front.onnx", "cloud/back.safetensors", "cloud/config.json", "calibration.json"}
    m.verify_files(tiny_glm4_bundle)
    calib = json.loads((tiny_glm4_bundle / "calibration.json").read_text())
    assert len(calib["outlier_channels"]) == 8 and len(calib["channel_absmax"]) == 64


def test_every_file_of_a_bundle_has_the_mode_a_new_file_gets(tiny_glm4_bundle):
    """safetensors writes through a private temporary file: cloud/back.safetensors came out 0600 where every other
    file is 0644 (umask 022), so a server running as another user - the Dockerfile's uid 10001 over a volume of
    bundles split by someone else - could not read the cloud half it must serve."""
    import stat

    modes = {p.relative_to(tiny_glm4_bundle).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in tiny_glm4_bundle.rglob("*") if p.is_file()}
    assert set(modes.values()) == {modes["manifest.json"]}, modes


def test_bundle_id_ties_halves_and_ignores_edge_variant(tiny_glm4_fp32_bundle, tiny_glm4_int8_bundle,
                                                        tiny_glm4_l1_bundle):
    # tiny-glm4 split at 2 (fp32 edge), at 2 (int8 edge), at 1 (fp32 edge): the session's bundles
    a, b, c = (Manifest.load(d) for d in (tiny_glm4_fp32_bundle, tiny_glm4_int8_bundle, tiny_glm4_l1_bundle))
    assert (a.split_layer, a.edge_quant, b.split_layer, b.edge_quant, c.split_layer) == (2, "fp32", 2, "int8", 1)
    assert a.bundle_id == b.bundle_id != c.bundle_id


def test_the_generation_configs_stop_tokens_are_the_bundles_and_in_its_id(llama_dir, tmp_path):
    """A checkpoint whose generation_config.json ends turns on more ids than its config (Llama-3-Instruct's
    <|eot_id|>) was split with the config's eos alone (the model's generate stops where the bundle did not), and
    that file was in neither the source identity nor a cloud file: two splits stopping at other tokens shared one
    bundle id, so a phone holding one edge half was served the other cloud half. The bundle stops where generate
    does, and the generation config is a cloud file under the id."""
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    g = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**g, "eos_token_id": [2, 7]}))  # the config says 2
    m = split(load_model(str(d)), SplitConfig(layer=1, out=tmp_path / "b", edge_quant="fp32"))
    assert m.eos_token_ids == [2, 7]
    assert json.loads((tmp_path / "b" / "cloud" / "generation_config.json").read_text())["eos_token_id"] == [2, 7]
    assert m.artifacts["cloud/generation_config.json"].role == "cloud"  # under the id: another file, another id
    m.artifacts["cloud/generation_config.json"].sha256 = "0" * 64
    assert m.compute_bundle_id() != m.bundle_id


def test_a_manifest_save_cut_short_keeps_the_manifest_before_it(tiny_glm4_bundle, tmp_path):
    """Manifest.save rewrote manifest.json in place: a write cut short (a full disk, here the file size limit, under
    draft-head's update of a bundle) left it truncated, and the whole bundle unreadable."""
    import shutil
    import subprocess
    import sys

    b = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, b)
    before = (b / "manifest.json").read_bytes()
    code = ("import resource, sys; from shared.manifest import Manifest; m = Manifest.load(sys.argv[1]); "
            "m.quant_report['note'] = 'x' * 4000; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "m.save(sys.argv[1])")
    r = subprocess.run([sys.executable, "-c", code, str(b)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "File too large" in r.stderr, r.stderr
    assert (b / "manifest.json").read_bytes() == before and sorted(p.name for p in b.iterdir()) == sorted(
        p.name for p in tiny_glm4_bundle.iterdir())


def test_edited_manifest_is_refused(tiny_glm4_bundle, tmp_path):
    import shutil

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    raw = json.loads((d / "manifest.json").read_text())
    raw["split_layer"] = 3
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(BundleError, match="bundle id does not match"):
        Manifest.load(d)


def test_split_refuses_to_overwrite_a_non_bundle(tmp_path, tiny_glm4_lm):
    (tmp_path / "precious.txt").write_text("x")
    with pytest.raises(BundleError, match="refusing to overwrite"):
        split(tiny_glm4_lm, SplitConfig(layer=2, out=tmp_path))


def test_fp32_prefill_is_an_option_of_quantized_edges(tmp_path):
    from partition_tools.cli import build_parser

    args = build_parser().parse_args(["split", "--preset", "tiny-glm4", "--layer", "2", "--fp32-prefill"])
    assert args.fp32_prefill and not build_parser().parse_args(["split", "--preset", "p"]).fp32_prefill
    assert not SplitConfig(layer=2, out=tmp_path).fp32_prefill  # off by default
    with pytest.raises(BundleError, match="--fp32-prefill is for a quantized edge"):
        SplitConfig(layer=2, out=tmp_path, edge_quant="fp32", fp32_prefill=True)


def test_an_interrupted_split_keeps_the_earlier_bundle_and_can_be_rerun(tiny_glm4_fp32_bundle, tiny_glm4_lm, tmp_path,
                                                                        monkeypatch):
    """Ctrl-C mid-split removed the bundle at --out first and left half a new one there (no manifest): it did not
    load, and the same command run again was refused ("exists and is not a bundle")."""
    import shutil

    import partition_tools.split as split_module

    out = tmp_path / "b"
    shutil.copytree(tiny_glm4_fp32_bundle, out)
    before = Manifest.load(out).bundle_id

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(split_module, "calibrate", interrupted)  # after the edge graph and the cloud weights are written
        with pytest.raises(KeyboardInterrupt):
            split(tiny_glm4_lm, SplitConfig(layer=1, out=out, edge_quant="fp32"))
    Manifest.load(out).verify_files(out)  # the earlier bundle, whole
    assert Manifest.load(out).bundle_id == before and sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    m = split(tiny_glm4_lm, SplitConfig(layer=1, out=out, edge_quant="fp32"))  # the rerun replaces it
    assert Manifest.load(out).bundle_id == m.bundle_id != before and m.split_layer == 1
    Manifest.load(out).verify_files(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
