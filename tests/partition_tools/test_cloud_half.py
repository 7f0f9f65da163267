"""partition_tools.cloud_half: the cloud half's format and CloudModel's three constructors and reference forward."""

from __future__ import annotations

import shutil

import pytest
import torch

from partition_tools.cloud_half import BACK_WEIGHTS, CloudModel
from partition_tools.models import load_model, tiny_glm4v_config
from shared.manifest import BundleError


def test_from_bundle_in_bf16_keeps_the_rotary_embedding_fp32(tiny_glm4_bundle):
    fp32 = CloudModel.from_bundle(tiny_glm4_bundle)
    bf16 = CloudModel.from_bundle(tiny_glm4_bundle, dtype=torch.bfloat16)
    assert bf16.dtype == bf16.lm_head.weight.dtype == bf16.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert bf16.rotary_emb.inv_freq.dtype == torch.float32  # a cast would round it: positions drift
    torch.testing.assert_close(bf16.rotary_emb.inv_freq, fp32.rotary_emb.inv_freq, rtol=0, atol=0)
    assert (bf16.num_layers, bf16.hidden_size, bf16.num_kv_heads, bf16.head_dim) == (2, 64, 2, 16)
    assert bf16.eos_token_ids == [2, 3] and bf16.manifest.split_layer == 2 and bf16.embed_tokens is None


def test_a_weight_file_missing_a_tensor_is_a_bundle_error(tiny_glm4_bundle, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    sd = load_file(str(d / BACK_WEIGHTS))
    del sd["norm.weight"]
    save_file(sd, str(d / BACK_WEIGHTS))
    with pytest.raises(BundleError, match="missing \\['norm.weight'\\]"):
        CloudModel.from_bundle(d, verify=False)
    with pytest.raises(BundleError):  # and the hashes catch it first by default
        CloudModel.from_bundle(d)



@pytest.mark.parametrize("path, data, match", [
    (BACK_WEIGHTS, None, "not a readable safetensors file"),  # cut in half
    ("cloud/config.json", b"{}", "not a model config"),  # no model_type
    ("cloud/config.json", b"{not json", "not a model config"),
])
def test_a_cloud_file_that_does_not_parse_is_a_bundle_error(tiny_glm4_bundle, tmp_path, path, data, match):
    """Behind hashes that match (a manifest re-hashed over them): a SafetensorError or TypeError traceback from
    `autoglm-partition verify` and inside the cloud server's start."""
    d = tmp_path / "b"
    shutil.copytree(tiny_glm4_bundle, d)
    p = d / path
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2] if data is None else data)
    with pytest.raises(BundleError, match=match) as e:
        CloudModel.from_bundle(d, verify=False)
    assert str(p) in str(e.value)

@pytest.mark.parametrize("source", ["tiny-glm4", "tiny-glm4v"])
def test_from_model_is_the_whole_model(source):
    lm = load_model(source)
    full = CloudModel.from_model(lm.model)
    ids = torch.randint(4, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = lm.model(input_ids=ids).logits  # [1, S, V]
        got = full(full.embed_tokens(ids), torch.arange(9)[None])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert full.num_layers == 4 and full.mrope == (source == "tiny-glm4v") and full.eos_token_ids == [2, 3]


def test_random_is_seeded_and_bounded():
    cfg = tiny_glm4v_config()
    a, b, c = (CloudModel.random(cfg, 1, seed=s) for s in (3, 3, 4))
    assert a.num_layers == 3 and a.mrope and a.embed_tokens is None and a.eos_token_ids == [2, 3]
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    for bad in (0, 4):
        with pytest.raises(ValueError, match="split layer must be in \\[1, 3\\]"):
            CloudModel.random(cfg, bad)


def test_multimodal_positions_only_for_a_3d_rope(tiny_glm4_bundle):
    v = CloudModel.random(tiny_glm4v_config(), 2)
    h, pos = torch.randn(1, 5, 64), torch.arange(5)[None]
    text = v.position_embeddings(h, pos)
    same = v.position_embeddings(h, pos, pos[None].expand(3, 1, 5))  # text positions on all three axes
    image = v.position_embeddings(h, pos, torch.zeros(3, 1, 5, dtype=torch.long))
    assert all(torch.equal(x, y) for x, y in zip(text, same, strict=True))
    assert not torch.equal(text[0], image[0])
    with pytest.raises(ValueError, match="without multimodal RoPE"):
        CloudModel.from_bundle(tiny_glm4_bundle).position_embeddings(h, pos, pos[None].expand(3, 1, 5))
